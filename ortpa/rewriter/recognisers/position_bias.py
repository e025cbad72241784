"""A per-head position bias on the attention scores (ALiBi: BLOOM, MPT, falcon-rw, Jais), found in every form an
export gives it, so the layer is refused by name before anything else is checked.

PagedAttention takes no additive bias on the scores: a layer with one cannot be converted, and converting it
without the bias writes a wrong model. The forms:

* **slopes times positions** computed at run time (transformers' ``build_alibi_tensor`` traced): a constant of
  per-head slopes multiplying positions from a ``CumSum`` of the attention mask or a ``Range``, added to the scores
  directly, through ``baddbmm`` over 3-D ``[batch * heads, ...]`` caches, or folded into the mask;
* **a constant table** (MPT's ``attn_bias`` buffer, sliced to the step): a float constant whose rows are linear in
  the position with a different slope per head;
* **a float mask input with a heads axis** (ALiBi folded into the attention mask by the caller): a graph input
  ``[batch, heads, query, key]`` added to the scores; a causal or padding mask has one row for every head.

:func:`score_bias` looks at what the scores are computed from, not walking into the ``q @ k^T`` product (RoPE's
frequency products live there), nor past ``Shape`` / ``Size``; :func:`layer_score_bias` finds the scores of a
layer from its value cache, whatever the caches' rank. Never mutates the graph.
"""

from __future__ import annotations

from collections import deque

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import const_array, consumers

__all__ = ["layer_score_bias", "positional_bias", "score_bias"]

_MAX_NODES = 400  # the mask and bias subgraph of any model is a few dozen nodes
_MAX_TABLE = 1 << 22  # elements of a constant read as a bias table
# what the walk does not enter: the q @ k^T product and projections, values' shapes only, RoPE's angles
_STOP = frozenset({"MatMul", "Gemm", "Shape", "Size", "Cos", "Sin"})
# ops a position passes through on its way to being scaled (arithmetic and layout, never a comparison)
_POSITION_PATH = frozenset(
    {"Cast", "Unsqueeze", "Squeeze", "Reshape", "Expand", "Slice", "Transpose", "Sub", "Add", "Mul", "Neg", "Identity"}
)
# what the value cache passes through on its way to MatMul(probabilities, v)
_LAYOUT = frozenset({"Reshape", "Transpose", "Unsqueeze", "Expand", "Cast", "Identity", "Squeeze"})


def _ancestors(values: list[ir.Value], stop: frozenset[str]) -> tuple[list[ir.Node], list[ir.Value]]:
    """The nodes ``values`` are computed from (up to a bound), not entering ``stop`` ops; and the graph inputs
    (not initializers) they read."""
    seen: dict[int, ir.Node] = {}
    inputs: dict[int, ir.Value] = {}
    queue = deque(values)
    while queue and len(seen) < _MAX_NODES:
        value = queue.popleft()
        node = value.producer()
        if node is None:
            if value.const_value is None and value.is_graph_input():
                inputs[id(value)] = value
            continue
        if id(node) in seen:
            continue
        seen[id(node)] = node
        if node.op_type in stop:
            continue
        queue.extend(v for v in node.inputs if v is not None and v.const_value is None)
    return list(seen.values()), list(inputs.values())


def _positions(value: ir.Value, depth: int = 8) -> bool:
    """Whether ``value`` is positions: computed from a ``CumSum`` (of the attention mask) or a ``Range`` through
    arithmetic and layout only (a mask compares positions; its booleans are not positions)."""
    frontier = [value]
    for _ in range(depth):
        nodes = [v.producer() for v in frontier]
        if any(n is not None and n.op_type in ("CumSum", "Range") for n in nodes):
            return True
        frontier = [
            v for n in nodes if n is not None and n.op_type in _POSITION_PATH for v in n.inputs if v is not None
        ]
    return False


def _slopes(arr: np.ndarray, heads: int | None) -> bool:
    """Per-head slopes: ``heads`` floats along one axis; with the head count unknown (3-D caches fold heads into
    the batch), at least two positive values at most 1, not all equal (ALiBi's are ``2^(-8 h / heads)``)."""
    if arr.dtype.kind != "f" or sum(n > 1 for n in arr.shape) > 1:
        return False
    if heads is not None:
        return arr.size == heads
    flat = arr.reshape(-1).astype(np.float64)
    return flat.size >= 2 and bool(np.all((flat > 0) & (flat <= 1))) and float(np.ptp(flat)) > 0


def _linear_rows(arr: np.ndarray) -> bool:
    """A table whose rows are linear in the last axis (the position), with different slopes (one per head)."""
    if arr.dtype.kind != "f" or arr.size > _MAX_TABLE:
        return False
    a = np.squeeze(arr.astype(np.float64))
    if a.ndim < 2 or a.shape[-1] < 2 or not np.all(np.isfinite(a)):
        return False
    steps = np.diff(a, axis=-1)
    first = steps[..., :1]
    if not np.allclose(steps, first, rtol=1e-3, atol=1e-6 * max(1.0, float(np.abs(a).max()))):
        return False
    return float(np.ptp(first)) > 0 and bool(np.all(first != 0))


def score_bias(scores: list[ir.Value], heads: int | None = None) -> str | None:
    """What adds a per-head position bias to the values ``scores`` (a softmax's input, an attention op's mask),
    said in a few words naming the node or value, or None (module docstring: the forms)."""
    nodes, inputs = _ancestors(scores, _STOP)
    for node in nodes:
        if node.op_type in _STOP:
            continue
        if node.op_type in ("Mul", "Div") and len(node.inputs) == 2:
            for operand, other in (node.inputs, tuple(reversed(node.inputs))):
                arr = const_array(operand)
                if arr is None or other is None or const_array(other) is not None:
                    continue
                if _slopes(arr, heads) and _positions(other):
                    return f"node {node.name!r} scales positions by per-head slopes"
        for operand in node.inputs:
            arr = const_array(operand) if operand is not None else None
            if arr is not None and arr.ndim >= 2 and _linear_rows(arr):
                return f"the constant {operand.name!r} read by node {node.name!r} holds a per-head linear position bias"
    for value in inputs:
        shape = value.shape
        dtype = value.dtype
        if shape is None or len(shape) != 4 or dtype is None or not dtype.is_floating_point():
            continue
        heads_dim = shape[1]
        if isinstance(heads_dim, int) and heads_dim > 1:
            return (
                f"the float mask input {value.name!r} {list(shape)} has a heads axis of {heads_dim}: a bias per head "
                "(ALiBi folded into the attention mask)"
            )
    return None


def positional_bias(masks: list[ir.Value], heads: int) -> ir.Node | None:
    """The node that scales positions by ``heads`` per-head slopes in what is added to the scores, or None: the
    check on a matched layer's masks, which knows the query heads (one head's ALiBi included)."""
    nodes, _ = _ancestors(masks, frozenset({"Shape", "Size"}))
    for node in nodes:
        if node.op_type not in ("Mul", "Div") or len(node.inputs) != 2:
            continue
        for operand, other in (node.inputs, tuple(reversed(node.inputs))):
            arr = const_array(operand)
            if arr is None or other is None or const_array(other) is not None:
                continue
            if _slopes(arr, heads) and _positions(other):
                return node
    return None


def _probabilities_reading(present_v: ir.Value) -> list[ir.Node]:
    """The ``MatMul(p, v)`` / ONNX ``Attention`` nodes reading the value cache, through layout ops."""
    found: list[ir.Node] = []
    seen: set[int] = set()
    queue = deque([present_v])
    while queue and len(seen) < 32:
        value = queue.popleft()
        for node in consumers(value):
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type in ("MatMul", "Attention") and len(node.inputs) > 1:
                found.append(node)
            elif node.op_type in _LAYOUT:
                queue.extend(node.outputs)
    return found


def _softmax_before(value: ir.Value) -> ir.Node | None:
    """The Softmax whose probabilities ``value`` is, through layout, Cast, Dropout and ``Where(_, _, p)``."""
    for _ in range(8):
        node = value.producer()
        if node is None or not node.inputs or node.inputs[0] is None:
            return None
        if node.op_type == "Softmax":
            return node
        if node.op_type == "Where" and len(node.inputs) == 3 and node.inputs[2] is not None:
            value = node.inputs[2]
        elif node.op_type in _LAYOUT or node.op_type == "Dropout":
            value = node.inputs[0]
        else:
            return None
    return None


def layer_score_bias(present_v: ir.Value) -> str | None:
    """:func:`score_bias` of the attention reading ``present_v`` (the value cache after its ``Concat``), found
    before any check of the caches' rank or the scores' form, so an ALiBi layer is named as such first."""
    for node in _probabilities_reading(present_v):
        if node.op_type == "Attention":
            mask = node.inputs[3] if len(node.inputs) > 3 else None
            if mask is not None:
                found = score_bias([mask])
                if found is not None:
                    return found
            continue
        softmax = _softmax_before(node.inputs[0])
        if softmax is not None:
            found = score_bias([softmax.inputs[0]])
            if found is not None:
                return found
    return None
