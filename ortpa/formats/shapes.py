"""A cache's head size when the graph leaves it a symbol (onnxruntime-genai's ``kv_cache_dim``).

genai builder models declare past/present as ``[batch, kv_heads, past, kv_cache_dim]``; the number is only in
the weights. It follows from what reads the past input:

* ``com.microsoft::GroupQueryAttention`` (past at input 3 / 4): the packed QKV width over
  ``num_heads + 2 * kv_num_heads``, or the separate key's (value's) width over ``kv_num_heads``;
* ``com.microsoft::MultiHeadAttention`` taking it as its own ``past_key`` / ``past_value`` (input 6 / 7, the
  genai phi fp16 form): the new key's (value's) width, input 1 / 2, over ``num_heads``;
* a ``Concat`` on the sequence axis (genai fp16's MultiHeadAttention form, TorchScript and dynamo exports): the
  last dim of the new tensor concatenated to the past.

Widths come from :mod:`ortpa.model.widths`, the walker the rewriter uses too. Functions take the graph as an
``onnx_ir`` model (:func:`ir_graph` makes one from a proto without copying its weights), so a caller asking
about every cache of a model deserializes it once.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from ortpa.errors import InvalidModel
from ortpa.model.widths import static_width

__all__ = ["cache_capacity", "cache_head_size", "constant_ints", "ir_graph"]


def ir_graph(model: onnx.ModelProto | ir.Model) -> ir.Graph:
    """The main graph of ``model`` in onnx-ir (a proto is wrapped, its tensors not copied)."""
    return (model if isinstance(model, ir.Model) else ir.serde.deserialize_model(model)).graph


def _value(graph: ir.Graph, name: str) -> ir.Value | None:
    for v in graph.inputs:
        if v.name == name:
            return v
    if name in graph.initializers:
        return graph.initializers[name]
    for node in graph:
        for out in node.outputs:
            if out.name == name:
                return out
    return None


def _attr(node: ir.Node, name: str) -> int:
    attr = node.attributes.get(name)
    if attr is None:
        raise InvalidModel(node.name or node.op_type, f"expected attribute {name!r} on {node.op_type}")
    return int(attr.value)


def _from_gqa(node: ir.Node, slot: int) -> int | None:
    heads, kv_heads = _attr(node, "num_heads"), _attr(node, "kv_num_heads")
    ins = node.inputs
    packed = len(ins) < 3 or ins[1] is None
    if packed:
        width = static_width(ins[0])
        return None if width is None else width // (heads + 2 * kv_heads)
    width = static_width(ins[1 if slot == 3 else 2])
    return None if width is None else width // kv_heads


def _from_mha(node: ir.Node, slot: int) -> int | None:
    if slot not in (6, 7):
        return None
    new = node.inputs[1 if slot == 6 else 2]
    width = None if new is None else static_width(new)
    return None if width is None else width // _attr(node, "num_heads")


def cache_head_size(graph: ir.Graph, past_input: str) -> int:
    """The head size of graph input ``past_input`` (a past key or value), from what reads it."""
    past = _value(graph, past_input)
    readers = [] if past is None else list(dict.fromkeys(past.consumers()))
    for node in readers:
        found: int | None = None
        if node.op_type == "GroupQueryAttention":
            found = _from_gqa(node, list(node.inputs).index(past))
        elif node.op_type == "MultiHeadAttention":
            found = _from_mha(node, list(node.inputs).index(past))
        elif node.op_type == "Concat":
            others = [i for i in node.inputs if i is not past]
            found = next((d for d in map(static_width, others) if d is not None), None)
        if found:
            return found
    kinds = sorted({n.op_type for n in readers})
    raise InvalidModel(
        past_input,
        f"expected the cache's head size to follow from what reads it (GroupQueryAttention, MultiHeadAttention's "
        f"past_key / past_value, or a Concat of new keys/values with static widths), found readers {kinds} and no "
        "static width",
    )


def constant_ints(graph: ir.Graph, name: str) -> list[int] | None:
    """The values of an initializer or ``Constant`` output ``name`` as ints (flattened), else ``None``."""
    value = _value(graph, name)
    tensor = None if value is None else ir.convenience.get_const_tensor(value)
    return None if tensor is None else [int(x) for x in tensor.numpy().reshape(-1)]


def cache_capacity(graph: ir.Graph, past_input: str) -> int | None:
    """The fixed length of a ring-buffer cache, or ``None`` for a cache that grows by concatenation.

    onnxruntime-genai gives a sliding-window layer a ``GroupQueryAttention`` with ``sliding_window_cache=1``: its
    past/present is a buffer of ``local_window_size`` rows (``past_sliding_length``) that the op writes in place,
    fed from the first step on (zeros), and returned at the same size.
    """
    past = _value(graph, past_input)
    for node in [] if past is None else past.consumers():
        if node.op_type != "GroupQueryAttention":
            continue
        window = node.attributes.get("local_window_size")
        sliding = node.attributes.get("sliding_window_cache")
        if sliding is not None and int(sliding.value) and window is not None and int(window.value) > 0:
            return int(window.value)
    return None
