"""The converted-model interface as the engine reads it from a paged model (docs/converted_model.md).

Inputs ``input_ids``, ``cumulative_sequence_lengths``, ``past_sequence_lengths``, ``block_table`` (required)
and ``attention_metadata``, ``position_ids``, ``logits_indices`` (optional; the last with an empty default: the
packed tokens whose logits a step computes) besides the KV caches, a ``logits`` output
(:func:`model_io`); the bytes one block id costs over every cache input (:func:`cache_bytes_per_block`, which
sizes the pool from a byte budget); and the positions the in-op RoPE tables hold (:func:`rotary_table_rows`,
which bounds a request's length).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from ortpa.errors import InvalidModel
from ortpa.model.kind import ModelKind, model_kind
from ortpa.ops.portable.calls import lowered_rotary_tables
from ortpa.runtime.ortvalues import numpy_dtype_for_onnx

__all__ = [
    "OPTIONAL_INPUTS",
    "REQUIRED_INPUTS",
    "ModelIO",
    "cache_bytes_per_block",
    "model_io",
    "rotary_table_rows",
]

REQUIRED_INPUTS = ("input_ids", "cumulative_sequence_lengths", "past_sequence_lengths", "block_table")
OPTIONAL_INPUTS = ("attention_metadata", "position_ids", "logits_indices")


@dataclass(frozen=True)
class ModelIO:
    """Which optional inputs the converted graph declares, and its vocabulary size if static."""

    attention_metadata: bool
    position_ids: bool
    vocab: int | None
    logits_indices: bool = False  # rows at the positions a step asks for (one pass over a scored prompt)


def model_io(model: onnx.ModelProto, cache_inputs: set[str]) -> ModelIO:
    """The interface ``model`` declares besides its ``cache_inputs``; :class:`InvalidModel` when it is not one."""
    inputs = [i.name for i in model.graph.input if i.name not in cache_inputs]
    where = model.graph.name or "model"
    missing = [n for n in REQUIRED_INPUTS if n not in inputs]
    unknown = [n for n in inputs if n not in REQUIRED_INPUTS + OPTIONAL_INPUTS]
    if missing or unknown:
        hint = "a dense model (no PagedAttention, no block_table): convert it first, `ortpa convert MODEL OUT`; "
        raise InvalidModel(
            where,
            (hint if model_kind(model) is ModelKind.DENSE else "")
            + f"expected the converted-model inputs {list(REQUIRED_INPUTS)} (+ optional {list(OPTIONAL_INPUTS)}) "
            f"and KV caches; missing {missing}, unexpected {unknown}",
        )
    logits = next((o for o in model.graph.output if o.name == "logits"), None)
    if logits is None:
        raise InvalidModel(where, f"expected a graph output 'logits'; found {[o.name for o in model.graph.output]}")
    dims = logits.type.tensor_type.shape.dim
    vocab = dims[-1].dim_value if len(dims) == 2 and dims[-1].HasField("dim_value") else None
    return ModelIO("attention_metadata" in inputs, "position_ids" in inputs, vocab, "logits_indices" in inputs)


def cache_bytes_per_block(model: onnx.ModelProto, cache_inputs: set[str], block_size: int) -> int:
    """Bytes one block id costs over every cache input, from their declared ``[.., .., kv_heads, head]`` dims."""
    total = 0
    for vi in model.graph.input:
        if vi.name not in cache_inputs:
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims) != 4 or not all(d.HasField("dim_value") for d in dims[2:]):
            raise InvalidModel(vi.name, "expected a cache input [num_blocks, block_size, kv_heads, head_size]")
        row = dims[2].dim_value * dims[3].dim_value
        total += block_size * row * np.dtype(numpy_dtype_for_onnx(vi.type.tensor_type.elem_type)).itemsize
    return total


def rotary_table_rows(model: onnx.ModelProto) -> int | None:
    """Positions the model's in-op RoPE tables hold (the fewest rows over every ``do_rotary=1`` node).

    ``None`` when no node rotates in the op, or a table's row count is not static (RoPE computed in the graph
    from ``position_ids`` has no table, hence no limit).
    """
    static: dict[str, int | None] = {
        init.name: (init.dims[0] if init.dims else None) for init in model.graph.initializer
    }
    for vi in [*model.graph.input, *model.graph.value_info]:
        dims = vi.type.tensor_type.shape.dim
        static.setdefault(vi.name, dims[0].dim_value if dims and dims[0].HasField("dim_value") else None)
    rows: list[int] = []
    for node in model.graph.node:
        if node.op_type != "PagedAttention" or node.domain != "com.microsoft":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if not attrs.get("do_rotary", 0):
            continue
        for name in node.input[8:10]:
            n = static.get(name)
            if n is None:
                return None
            rows.append(int(n))
    for names in lowered_rotary_tables(model):  # a file lowered by `convert --portable`: the same tables
        for name in names:
            n = static.get(name)
            if n is None:
                return None
            rows.append(int(n))
    return min(rows) if rows else None
