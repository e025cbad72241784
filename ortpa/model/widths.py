"""Static dimensions a graph leaves symbolic, recovered by walking back to the weights (one walker, on onnx-ir).

onnx's shape inference stops at ONNX Runtime's contrib ops (``GroupQueryAttention``, ``MatMulNBits``,
``SkipSimplifiedLayerNormalization``...) and at reshapes of symbolic dims, yet the numbers a converter or a
parity run needs (a projection's width, a cache's head size) sit in the weights a few ops upstream. :func:`dim`
walks producers from a value to the dim it asks for: projection weights (``MatMul``, ``Gemm``, ``MatMulNBits``'
``N``), a bias ``Add``, constant ``Reshape`` targets (``0`` copies, ``-1`` inferred), ``Transpose``, ``Split``
sizes, an embedding ``Gather`` and the shape-preserving ops in between. Axes count from the end (``-1`` is the
last dim), which every op on the way preserves or maps; a dim the walk cannot prove is ``None``.

Both :mod:`ortpa.rewriter` (head counts and widths of attention inputs) and :mod:`ortpa.formats` (a dense
cache's head size) ask this one walker.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

__all__ = ["dim", "static_width"]

# Ops whose output 0 has the shape of input 0 (element-wise with a broadcast operand, casts, normalisations).
_SAME_SHAPE = frozenset(
    {
        "Cast",
        "Identity",
        "Sigmoid",
        "Neg",
        "Relu",
        "Mul",
        "Div",
        "Sub",
        "SimplifiedLayerNormalization",
        "SkipSimplifiedLayerNormalization",
        "LayerNormalization",
        "SkipLayerNormalization",
        "RotaryEmbedding",
    }
)
_MAX_DEPTH = 16


def _const(value: ir.Value | None) -> np.ndarray | None:
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def _int_attr(node: ir.Node, name: str, default: int | None = None) -> int | None:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def _declared(value: ir.Value, axis: int) -> int | None:
    shape = value.shape
    if shape is None or not -len(shape) <= axis < len(shape):
        return None
    d = shape[axis]
    return d if isinstance(d, int) else None


def _rank(value: ir.Value | None, depth: int = _MAX_DEPTH) -> int | None:
    """The rank of ``value``: declared, or carried through its producers (shape inference may not have run)."""
    if value is None or depth <= 0:
        return None
    if value.shape is not None:
        return len(value.shape)
    node = value.producer()
    if node is None:
        return None
    op, ins = node.op_type, node.inputs
    if op in _SAME_SHAPE or op in ("Add", "MatMulNBits", "Split"):
        return _rank(ins[0], depth - 1)
    if op == "MatMul" and len(ins) > 1:
        a, b = _rank(ins[0], depth - 1), _rank(ins[1], depth - 1)
        return None if a is None or b is None else max(a, b)
    if op == "Gemm":
        return 2
    if op == "Transpose" and node.attributes.get("perm") is not None:
        return len(node.attributes["perm"].value)
    if op == "Reshape" and len(ins) > 1:
        target = _const(ins[1])
        return None if target is None else int(target.size)
    if op == "Gather" and len(ins) > 1:
        a, b = _rank(ins[0], depth - 1), _rank(ins[1], depth - 1)
        return None if a is None or b is None else a + b - 1
    return None


def static_width(value: ir.Value | None) -> int | None:
    """The last dimension of ``value`` (a projection's output width), or ``None`` when the graph does not fix it."""
    return dim(value, -1)


def dim(value: ir.Value | None, axis: int, depth: int = _MAX_DEPTH) -> int | None:
    """Dimension ``axis`` (negative: from the end) of ``value``, from its declared shape or its producers."""
    if value is None or depth <= 0 or axis >= 0:
        return None
    known = _declared(value, axis)
    if known is not None:
        return known
    node = value.producer()
    if node is None:
        return None
    op, ins, deeper = node.op_type, node.inputs, depth - 1
    out_index = list(node.outputs).index(value)
    if op in _SAME_SHAPE:
        # Skip*Normalization's last output is the residual sum (input + skip), the same shape as output 0
        if out_index == 0 or (op.startswith("Skip") and out_index == len(node.outputs) - 1):
            return dim(ins[0], axis, deeper)
        return None
    if op == "Add" and len(ins) == 2:
        bias = _const(ins[1])
        if axis == -1 and bias is not None and bias.ndim >= 1 and bias.shape[-1] > 1:
            return int(bias.shape[-1])
        return dim(ins[0], axis, deeper)
    if op == "MatMulNBits" and node.domain == "com.microsoft":
        return _int_attr(node, "N") if axis == -1 else dim(ins[0], axis, deeper)
    if op in ("MatMul", "Gemm") and len(ins) > 1:
        if axis != -1:
            return dim(ins[0], axis, deeper)
        weight = _const(ins[1])
        if weight is not None and weight.ndim >= 1:
            transposed = op == "Gemm" and _int_attr(node, "transB", 0)
            return int(weight.shape[0] if transposed else weight.shape[-1])
        return dim(ins[1], -1, deeper)  # a weight computed in the graph (dequantised) with a known shape
    if op == "Transpose":
        perm = node.attributes.get("perm")
        rank = len(perm.value) if perm is not None else _rank(ins[0])
        if rank is None or -axis > rank:
            return None
        order = [int(p) for p in perm.value] if perm is not None else list(reversed(range(rank)))
        return dim(ins[0], order[rank + axis] - rank, deeper)
    if op == "Reshape" and len(ins) > 1:
        return _reshape_dim(ins[0], _const(ins[1]), axis, deeper)
    if op == "Split":
        return _split_dim(node, out_index, axis, deeper)
    if op == "Gather" and _int_attr(node, "axis", 0) == 0:
        data_rank = _rank(ins[0])
        if data_rank is not None and -axis < data_rank:  # output = indices' shape + data's trailing dims
            return dim(ins[0], axis, deeper)
        return None
    return None


def _reshape_dim(data: ir.Value, target: np.ndarray | None, axis: int, depth: int) -> int | None:
    if target is None or target.ndim != 1 or -axis > target.size:
        return None
    shape = [int(t) for t in target]
    pos = len(shape) + axis
    t = shape[pos]
    if t > 0:
        return t
    rank = _rank(data)
    if rank is None:
        return None
    if t == 0:  # copies the input's dim at the same (positive) index
        return dim(data, pos - rank, depth) if pos < rank else None
    # -1: dims copied with 0 appear on both sides and cancel; the rest of the input over the rest of the target
    copied = {i for i, v in enumerate(shape) if v == 0}
    rest_in = [dim(data, i - rank, depth) for i in range(rank) if i not in copied]
    if any(d is None for d in rest_in):
        return None
    rest_out = [v for i, v in enumerate(shape) if i not in copied and v != -1]
    return math.prod(rest_in) // max(math.prod(rest_out), 1)  # type: ignore[arg-type]


def _split_dim(node: ir.Node, out_index: int, axis: int, depth: int) -> int | None:
    data = node.inputs[0]
    rank = _rank(data)
    split_axis = _int_attr(node, "axis", 0)
    if rank is None and split_axis >= 0:
        return None
    if split_axis >= 0:
        split_axis -= rank  # type: ignore[operator]
    if axis != split_axis:
        return dim(data, axis, depth)
    sizes = _const(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    if sizes is None:
        attr = node.attributes.get("split")
        sizes = None if attr is None else np.asarray(attr.value)
    return None if sizes is None else int(sizes.reshape(-1)[out_index])
