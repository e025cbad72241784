"""One-node PagedAttention models: the op alone, as written and lowered (the harness of tests and benchmarks)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import onnx
from onnx import helper

from ortpa.dtypes import onnx_elem_type
from ortpa.ops.portable.config import DEFAULT_OPSET
from ortpa.ops.portable.lower import lower_to_portable
from ortpa.ops.spec import DOMAIN, OP_TYPE, PAGED_ATTENTION
from ortpa.ops.validate import dtype_name

__all__ = ["paged_attention_model", "portable_single_node_model"]

# the element types a PagedAttention model's inputs may have (activations, caches, scales, index tensors)
_ELEMENT_TYPES = frozenset({"float16", "bfloat16", "int8", "float8e4m3fn", "uint8", "int32", "float32"})


def _elem(array: Any) -> int:
    name = dtype_name(array.dtype)
    if name not in _ELEMENT_TYPES:
        raise TypeError(f"paged_attention_model: expected an element type in {sorted(_ELEMENT_TYPES)}, found {name}")
    return onnx_elem_type(name)


def paged_attention_model(
    inputs: Mapping[str, Any],
    attrs: Mapping[str, Any],
    *,
    cache_outputs: bool = True,
    opset: int = DEFAULT_OPSET,
    node_name: str = "PagedAttention_0",
) -> onnx.ModelProto:
    """A one-node ``com.microsoft::PagedAttention`` model whose graph inputs are the present ``inputs``.

    ``inputs`` maps schema names to arrays (or ``.shape``/``.dtype`` stand-ins); only their element types and
    head dimensions are fixed in the model: token, batch, block and row counts are symbolic, so one session
    serves every batch. Graph names are the schema names (outputs: ``output``, ``key_cache_out``,
    ``value_cache_out``).
    """
    sym = {
        "query": ["T", None],
        "key": ["T", None],
        "value": ["T", None],
        "key_cache": ["NB", "BS", None, None],
        "value_cache": ["NB", "BS", None, None],
        "cumulative_sequence_length": ["B1"],
        "past_seqlens": ["B"],
        "block_table": ["B", "MB"],
        "cos_cache": ["P", None],
        "sin_cache": ["P", None],
        "slot_mapping": ["T"],
    }
    names, vis = [], []
    for f in PAGED_ATTENTION.inputs:
        a = inputs.get(f.name)
        if a is None:
            names.append("")
            continue
        dims = [s if s is not None else d for s, d in zip(sym.get(f.name, [None] * len(a.shape)), a.shape, strict=True)]
        names.append(f.name)
        vis.append(helper.make_tensor_value_info(f.name, _elem(a), dims))
    while names and names[-1] == "":
        names.pop()
    latent = attrs.get("kv_cache_layout", "SEPARATE") == "LATENT"
    out_names = ["output"]
    if cache_outputs:
        out_names += ["key_cache_out"] if latent else ["key_cache_out", "value_cache_out"]
    q = inputs["query"]
    outs = [helper.make_tensor_value_info("output", _elem(q), ["T", None])]
    for name, src in (("key_cache_out", "key_cache"), ("value_cache_out", "value_cache")):
        if name in out_names:
            outs.append(helper.make_tensor_value_info(name, _elem(inputs[src]), ["NB", "BS", None, None]))
    node = helper.make_node(OP_TYPE, names, out_names, name=node_name, domain=DOMAIN, **dict(attrs))
    graph = helper.make_graph([node], "paged_attention", vis, outs)
    return helper.make_model(
        graph,
        opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid(DOMAIN, 1)],
        ir_version=10,
    )


def portable_single_node_model(
    inputs: Mapping[str, Any], attrs: Mapping[str, Any], *, cache_outputs: bool = True
) -> onnx.ModelProto:
    """:func:`paged_attention_model` lowered by :func:`lower_to_portable` (the test and benchmark harness)."""
    return lower_to_portable(paged_attention_model(inputs, attrs, cache_outputs=cache_outputs))
