"""Values a graph computes from its static shapes and constants, folded here so a recogniser can read them.

An exporter may compute what is a constant of the model at run time: torch's scaled-dot-product decomposition
scales q and k by ``Sqrt(1 / Sqrt(Cast(Shape(q)[-1:])))``, i.e. ``head_dim ** -0.25`` read from q's shape. The
onnxscript optimizer folds ``Shape`` only when the whole shape is static, so this survives pre-optimisation when
the batch or sequence axes are symbolic. :func:`fold_static` evaluates such a value when every dimension it
reads is static; :func:`runtime_scalar` tells a recogniser that a one-element operand is computed at run time
and cannot be folded, so it refuses instead of assuming a default. Nothing here mutates the graph.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import attr_value, const_array

_MAX_FOLDED_ELEMENTS = 64  # shapes and scalars; never a weight-sized tensor
# a constant larger than this is never read while folding: what folds is shape arithmetic and scalars, and reading
# a weight (external data) to find that out cost seconds on a 30-layer model
_MAX_READ_ELEMENTS = 1 << 16

__all__ = [
    "fold_partial",
    "fold_shape_values",
    "fold_static",
    "folded_scalar",
    "register_loose_constants",
    "runtime_scalar",
]

_UNARY = {
    "Sqrt": np.sqrt,
    "Reciprocal": np.reciprocal,
    "Neg": np.negative,
    "Exp": np.exp,
    "Log": np.log,
    "Abs": np.abs,
    "Identity": lambda x: x,
}
_BINARY = {"Mul": np.multiply, "Div": np.divide, "Add": np.add, "Sub": np.subtract, "Pow": np.power}


def _numeric(arr: np.ndarray | None) -> np.ndarray | None:
    """``arr`` when it holds only numbers (a shape with a symbolic dim holds None there)."""
    if arr is None:
        return None
    arr = np.asarray(arr)
    if arr.dtype == object and any(v is None for v in arr.reshape(-1)):
        return None
    return arr.astype(np.int64) if arr.dtype == object else arr


def _shape(node: ir.Node) -> np.ndarray | None:
    value = node.inputs[0]
    if value is None or value.shape is None:
        return None
    dims = np.array([d if isinstance(d, int) else None for d in value.shape], dtype=object)
    start, end = int(attr_value(node, "start", 0)), attr_value(node, "end", None)
    return dims[start : None if end is None else int(end)]


def fold_static(value: ir.Value | None, depth: int = 16, memo: dict | None = None) -> np.ndarray | None:
    """``value`` as an array when it is computed only from constants and static dimensions, else None.

    Partial shapes are followed: ``Shape(x)[-1:]`` folds when x's last dimension is static, whatever the others.
    ``memo``: results kept across calls on one unchanged graph (each value is then folded once).
    """
    arr = _fold(value, depth, {} if memo is None else memo)
    return _numeric(arr)


def fold_partial(value: ir.Value | None, depth: int = 16) -> np.ndarray | None:
    """As :func:`fold_static`, but a shape-like vector may hold None where a dimension is symbolic
    (``Concat(Shape(x)[:2], [4, 48])`` -> ``[None, None, 4, 48]``)."""
    arr = _fold(value, depth, {})
    return None if arr is None else np.asarray(arr)


def _fold(value: ir.Value | None, depth: int, memo: dict) -> np.ndarray | None:
    if value is None or depth <= 0:
        return None
    key = (id(value), depth)
    if key not in memo:
        memo[key] = _fold_value(value, depth, memo)
    return memo[key]


def _fold_value(value: ir.Value, depth: int, memo: dict) -> np.ndarray | None:
    stored = value.const_value
    if stored is not None and stored.size > _MAX_READ_ELEMENTS:
        return None
    const = const_array(value)
    if const is not None:
        return const
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
        return None
    op = node.op_type
    if op == "Shape":
        return _shape(node)
    args = [_fold(v, depth - 1, memo) if v is not None else None for v in node.inputs]
    if any(a is None for a in args[:1]):
        return None
    try:
        if op in ("Slice", "Gather", "Unsqueeze", "Squeeze", "Concat", "Reshape"):
            moved = _layout(node, op, args)
            return None if moved is None else np.asarray(moved, dtype=object if moved.dtype == object else None)
        nums = [_numeric(a) for a in args]
        if any(n is None for n in nums):
            return None
        if op == "Cast":
            return nums[0].astype(ir.DataType(int(attr_value(node, "to"))).numpy())
        if op in _UNARY:
            return np.asarray(_UNARY[op](nums[0]))
        if op in _BINARY and len(nums) == 2:
            return np.asarray(_BINARY[op](nums[0], nums[1])).astype(np.result_type(nums[0]))
    except (ValueError, TypeError, IndexError, ZeroDivisionError, FloatingPointError):
        return None
    return None


def _layout(node: ir.Node, op: str, args: list[np.ndarray | None]) -> np.ndarray | None:
    """Ops that move elements without computing: a symbolic dim (None) may pass through them."""
    data = args[0]
    assert data is not None
    rest = [_numeric(a) for a in args[1:]]
    if op == "Slice":
        if len(rest) < 2 or rest[0] is None or rest[1] is None or data.ndim != 1:
            return None
        step = int(rest[3][0]) if len(rest) > 3 and rest[3] is not None else 1
        return data[int(rest[0][0]) : int(min(rest[1][0], 2**62)) : step]
    if op == "Gather":
        if not rest or rest[0] is None:
            return None
        taken = np.take(data, rest[0].astype(np.int64), axis=int(attr_value(node, "axis", 0)))
        return np.asarray(taken, dtype=data.dtype)
    if op == "Concat":
        if any(a is None for a in args):
            return None
        return np.concatenate([np.atleast_1d(a) for a in args], axis=int(attr_value(node, "axis", 0)))
    if op == "Unsqueeze" and rest and rest[0] is not None:
        out = data
        for axis in sorted(int(a) for a in rest[0].reshape(-1)):
            out = np.expand_dims(out, axis)
        return out
    if op == "Squeeze":
        axes = tuple(int(a) for a in rest[0].reshape(-1)) if rest and rest[0] is not None else None
        return np.squeeze(data, axis=axes)
    if op == "Reshape" and rest and rest[0] is not None and all(int(d) > 0 for d in rest[0].reshape(-1)):
        return data.reshape([int(d) for d in rest[0].reshape(-1)])
    return None


def folded_scalar(value: ir.Value | None) -> np.ndarray | None:
    """A one-element constant or static-foldable value, as a 0-d array (its dtype kept); None otherwise."""
    arr = fold_static(value)
    return None if arr is None or arr.size != 1 else arr.reshape(())


def runtime_scalar(value: ir.Value | None) -> bool:
    """Whether ``value`` is a one-element tensor computed at run time (not a constant, not foldable): a factor
    a recogniser cannot read. Judged by its static shape (rank 0, or every dimension 1)."""
    if value is None or value.const_value is not None:
        return False
    if value.shape is None or not all(isinstance(d, int) and d == 1 for d in value.shape):
        return False
    return fold_static(value) is None


def register_loose_constants(graph: ir.Graph) -> int:
    """Register as initializers the constants nodes read that are neither initializers nor node outputs; how many.

    onnxscript 0.7's optimizer rewrites a second ``Flatten`` of one value (optimum's DeepSeek-V3 router) into a
    ``Reshape`` whose shape is such a loose constant: it is not serialized, so shape inference and ONNX Runtime
    would see a graph input missing."""
    count = 0
    for node in graph:
        for value in node.inputs:
            if value is None or value.const_value is None or value.producer() is not None or value.is_initializer():
                continue
            if value.is_graph_input():
                continue
            base = value.name or "constant"
            name, k = base, 0
            while name in graph.initializers:
                k += 1
                name = f"{base}.{k}"
            value.name = name
            graph.register_initializer(value)
            count += 1
    return count


def fold_shape_values(model: ir.Model) -> int:
    """Replace, in place, every value computed from static dimensions read with ``Shape`` (and constants) by
    an initializer; return how many remain in use. The onnxscript optimizer folds ``Shape`` only when the whole
    shape is static; a partial read (``Shape(q)[-1:]`` with symbolic batch and sequence) is left to this pass,
    so the recognisers see a constant (the attention scale) and the per-sequence checks no token count. Nodes
    left without users are removed."""
    from onnx_ir.passes.common import RemoveUnusedNodesPass

    graph = model.graph
    shape_fed: set[int] = set()  # nodes whose value depends on a Shape
    made: list[ir.Value] = []
    folded: set[int] = set()  # ids of the constants made here: what reads them is shape arithmetic too
    memo: dict = {}  # a folded value's uses move to a constant of the same value: the memo stays true
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or len(node.outputs) != 1:
            continue
        if node.op_type != "Shape" and not any(
            v is not None and (id(v) in folded or (v.producer() is not None and id(v.producer()) in shape_fed))
            for v in node.inputs
        ):
            continue
        shape_fed.add(id(node))
        out = node.outputs[0]
        if node.op_type == "Shape" or not out.consumers() or any(o is out for o in graph.outputs):
            continue
        arr = fold_static(out, memo=memo)
        if arr is None or arr.size > _MAX_FOLDED_ELEMENTS:
            continue
        name = f"{out.name}.folded"
        tensor = ir.tensor(np.array(arr, order="C"), name=name)
        const = ir.Value(name=name, shape=ir.Shape(arr.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
        graph.register_initializer(const)
        out.replace_all_uses_with(const)
        made.append(const)
        folded.add(id(const))
    if not made:
        return 0
    for const in made:  # folded intermediates whose users were folded in turn
        if not const.uses():
            graph.initializers.pop(const.name)
    RemoveUnusedNodesPass()(model)
    return sum(1 for c in made if c.name in graph.initializers)
