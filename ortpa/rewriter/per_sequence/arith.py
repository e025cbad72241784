"""Element-wise ONNX arithmetic on numpy arrays: what the per-sequence flow evaluates an index expression with on
sample positions (the sorted rows of :mod:`~ortpa.rewriter.per_sequence.routes`, the selected coordinates of
:mod:`~ortpa.rewriter.per_sequence.selections`)."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import int_attr

__all__ = ["elementwise"]

_BINARY = {
    "Add": np.add,
    "Sub": np.subtract,
    "Mul": np.multiply,
    "Less": np.less,
    "LessOrEqual": np.less_equal,
    "Greater": np.greater,
    "GreaterOrEqual": np.greater_equal,
    "Equal": np.equal,
    "And": np.logical_and,
    "Or": np.logical_or,
    "Max": np.maximum,
    "Min": np.minimum,
}


def elementwise(node: ir.Node, args: list[np.ndarray | None]) -> np.ndarray | None:
    """``node``'s element-wise arithmetic (casts, comparisons, logic, ``Where``, ONNX's truncating integer ``Div``)
    on numpy ``args``; None for another op or a missing input."""
    op = node.op_type
    if any(a is None for a in args[: 3 if op == "Where" else (1 if op in ("Cast", "Not", "Neg", "Abs") else 2)]):
        return None
    a = args[0]
    with np.errstate(all="ignore"):
        if op == "Cast":
            return _cast(a, int_attr(node, "to", 0))
        if op == "Not":
            return np.logical_not(a)
        if op == "Neg":
            return np.negative(a)
        if op == "Abs":
            return np.abs(a)
        if op == "Where":
            return np.where(a, args[1], args[2])
        b = args[1]
        if op == "Div":
            if np.issubdtype(np.result_type(a, b), np.integer):
                if np.any(b == 0):
                    return None
                return (np.abs(a) // np.abs(b)) * np.sign(a) * np.sign(b)  # ONNX integer Div truncates
            return np.divide(a, b)
        if op == "Mod":
            return np.fmod(a, b) if int_attr(node, "fmod", 0) else np.mod(a, b)
        if op in _BINARY:
            return _BINARY[op](a, b)
    return None


def _cast(a: np.ndarray, to: int) -> np.ndarray | None:
    try:
        dtype = ir.DataType(to).numpy()
    except (ValueError, TypeError):
        return None
    return np.asarray(a).astype(dtype)
