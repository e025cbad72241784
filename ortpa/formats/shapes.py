"""A cache's head size when the graph leaves it a symbol (onnxruntime-genai's ``kv_cache_dim``).

genai builder models declare past/present as ``[batch, kv_heads, past, kv_cache_dim]``; the number is only in
the weights. It follows from what reads the past input:

* ``com.microsoft::GroupQueryAttention`` (past at input 3 / 4): the packed QKV width over
  ``num_heads + 2 * kv_num_heads``, or the separate key's (value's) width over ``kv_num_heads``;
* a ``Concat`` on the sequence axis (genai fp16's MultiHeadAttention form, TorchScript and dynamo exports): the
  last dim of the new tensor concatenated to the past.

Widths come from a small forward walk of static dims (projection weights, ``MatMulNBits``' ``N``, constant
``Reshape`` targets, ``Transpose``); onnx's shape inference cannot do this because it does not know ONNX
Runtime's contrib ops.
"""

from __future__ import annotations

import math

import onnx
from onnx import numpy_helper

from ortpa.errors import InvalidModel

__all__ = ["cache_capacity", "cache_head_size", "constant_ints"]

Shape = list[int | None]

# Ops whose output 0 has the shape of input 0.
_SAME_SHAPE = {
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Cast",
    "Identity",
    "Sigmoid",
    "Neg",
    "Relu",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "LayerNormalization",
    "SkipLayerNormalization",
    "RotaryEmbedding",
}


class _Walker:
    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.producer = {o: n for n in g.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
        self.init = {t.name: t for t in g.initializer}
        self.inputs = {v.name: v for v in g.input}
        self.memo: dict[str, Shape | None] = {}

    def const(self, name: str) -> list[int] | None:
        if name in self.init:
            return [int(x) for x in numpy_helper.to_array(self.init[name]).reshape(-1)]
        node = self.producer.get(name)
        if node is not None and node.op_type == "Constant":
            for a in node.attribute:
                if a.name == "value":
                    return [int(x) for x in numpy_helper.to_array(a.t).reshape(-1)]
        return None

    def shape(self, name: str) -> Shape | None:
        if name not in self.memo:
            self.memo[name] = None  # cycles cannot happen in a valid graph; this also bounds recursion
            self.memo[name] = self._shape(name)
        return self.memo[name]

    def _shape(self, name: str) -> Shape | None:
        if name in self.init:
            return [int(d) for d in self.init[name].dims]
        if name in self.inputs:
            dims = self.inputs[name].type.tensor_type.shape.dim
            return [d.dim_value if d.HasField("dim_value") else None for d in dims]
        node = self.producer.get(name)
        if node is None:
            return None
        op = node.op_type
        # Skip*Normalization's output 3 is the residual sum (input + skip), the same shape as output 0.
        if op in _SAME_SHAPE and (name == node.output[0] or (op.startswith("Skip") and name == node.output[-1])):
            return self.shape(node.input[0])
        if op == "MatMul":
            a, b = self.shape(node.input[0]), self.shape(node.input[1])
            if a is None or b is None or not b:
                return None
            return [*a[:-1], b[-1]]
        if op == "MatMulNBits":
            a = self.shape(node.input[0])
            n = next((x.i for x in node.attribute if x.name == "N"), None)
            return None if a is None else [*a[:-1], n]
        if op == "Gather":
            data, idx = self.shape(node.input[0]), self.shape(node.input[1])
            axis = next((x.i for x in node.attribute if x.name == "axis"), 0)
            if data is None or idx is None or axis != 0:
                return None
            return [*idx, *data[1:]]
        if op == "Transpose":
            a = self.shape(node.input[0])
            perm = next((list(x.ints) for x in node.attribute if x.name == "perm"), None)
            if a is None:
                return None
            return [a[p] for p in (perm or reversed(range(len(a))))]
        if op == "Reshape":
            return self._reshape(node)
        if op == "Split":
            return self._split(node, list(node.output).index(name))
        return None

    def _split(self, node: onnx.NodeProto, index: int) -> Shape | None:
        a = self.shape(node.input[0])
        sizes = self.const(node.input[1]) if len(node.input) > 1 and node.input[1] else None
        if a is None or sizes is None:
            return None
        axis = next((x.i for x in node.attribute if x.name == "axis"), 0)
        out = list(a)
        out[axis] = sizes[index]
        return out

    def _reshape(self, node: onnx.NodeProto) -> Shape | None:
        a, target = self.shape(node.input[0]), self.const(node.input[1])
        if a is None or target is None:
            return None
        out: Shape = [a[i] if t == 0 and i < len(a) else (t if t > 0 else None) for i, t in enumerate(target)]
        if -1 in target:
            # Dims copied with 0 appear on both sides and cancel: -1 = (the rest of the input) / (the rest of
            # the target), which needs only those dims to be known.
            copied = {i for i, t in enumerate(target) if t == 0}
            rest_in = [d for i, d in enumerate(a) if i not in copied]
            rest_out = [t for i, t in enumerate(target) if i not in copied and t != -1]
            if any(d is None for d in rest_in):
                return out
            out[target.index(-1)] = math.prod(rest_in) // max(math.prod(rest_out), 1)
        return out

    def last_dim(self, name: str) -> int | None:
        s = self.shape(name)
        return s[-1] if s else None


def _attr(node: onnx.NodeProto, name: str) -> int:
    for a in node.attribute:
        if a.name == name:
            return a.i
    raise InvalidModel(node.name, f"expected attribute {name!r} on {node.op_type}")


def _from_gqa(w: _Walker, node: onnx.NodeProto, slot: int) -> int | None:
    heads, kv_heads = _attr(node, "num_heads"), _attr(node, "kv_num_heads")
    packed = len(node.input) < 3 or not node.input[1]
    if packed:
        width = w.last_dim(node.input[0])
        return None if width is None else width // (heads + 2 * kv_heads)
    width = w.last_dim(node.input[1 if slot == 3 else 2])
    return None if width is None else width // kv_heads


def cache_head_size(model: onnx.ModelProto, past_input: str) -> int:
    """The head size of graph input ``past_input`` (a past key or value), from what reads it."""
    w = _Walker(model)
    for node in w.consumers.get(past_input, []):
        found: int | None = None
        if node.op_type == "GroupQueryAttention":
            found = _from_gqa(w, node, list(node.input).index(past_input))
        elif node.op_type == "Concat":
            others = [i for i in node.input if i != past_input]
            found = next((d for d in map(w.last_dim, others) if d is not None), None)
        if found:
            return found
    readers = sorted({n.op_type for n in w.consumers.get(past_input, [])})
    raise InvalidModel(
        past_input,
        f"expected the cache's head size to follow from what reads it (GroupQueryAttention or a Concat of new "
        f"keys/values with static widths), found readers {readers} and no static width",
    )


def constant_ints(model: onnx.ModelProto, name: str) -> list[int] | None:
    """The values of an initializer or ``Constant`` output ``name`` as ints (flattened), else ``None``."""
    return _Walker(model).const(name)


def cache_capacity(model: onnx.ModelProto, past_input: str) -> int | None:
    """The fixed length of a ring-buffer cache, or ``None`` for a cache that grows by concatenation.

    onnxruntime-genai gives a sliding-window layer a ``GroupQueryAttention`` with ``sliding_window_cache=1``: its
    past/present is a buffer of ``local_window_size`` rows (``past_sliding_length``) that the op writes in place,
    fed from the first step on (zeros), and returned at the same size.
    """
    for node in _Walker(model).consumers.get(past_input, []):
        if node.op_type != "GroupQueryAttention":
            continue
        attrs = {a.name: a.i for a in node.attribute if a.type == onnx.AttributeProto.INT}
        if attrs.get("sliding_window_cache", 0) and attrs.get("local_window_size", -1) > 0:
            return attrs["local_window_size"]
    return None
