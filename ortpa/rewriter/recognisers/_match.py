"""Structural-match helpers shared by the attention matchers (:mod:`~ortpa.rewriter.recognisers.mla` for MLA,
:mod:`~ortpa.rewriter.recognisers.decomposed` for MHA / GQA): the failure type and its report, and the walks both use
from a cache input to the attention core. Nothing here mutates the graph.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import TypeVar

import onnx_ir as ir
from onnxscript.rewriter import MatchResult

from ortpa.rewriter._fold import fold_static, runtime_scalar
from ortpa.rewriter._graph import consumers, int_attr, producer_op, scalar
from ortpa.rewriter.layer import LayerFailure

T = TypeVar("T")

__all__ = [
    "MatchFail",
    "cache_concat",
    "cache_inputs",
    "cache_layers",
    "consumer_ops",
    "graph_input",
    "match_or_failure",
    "need",
    "reaches",
    "softmax_of",
    "strip_scales",
]


class MatchFail(Exception):
    """A failed structural check: the reason, an onnxscript ``MatchResult``, and the value or node's name."""

    def __init__(self, reason: str, where: ir.Value | ir.Node | None) -> None:
        super().__init__(reason)
        self.result = MatchResult().fail(reason, where)
        self.reason = reason
        self.where = "" if where is None else (where.name or "?")


def need(cond: object, reason: str, where: ir.Value | ir.Node | None) -> None:
    if not cond:
        raise MatchFail(reason, where)


def graph_input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


def consumer_ops(value: ir.Value) -> list[str]:
    """The op types reading ``value``, sorted and without repeats (for failure messages)."""
    return sorted({n.op_type for n in value.consumers()})


def cache_concat(past: ir.Value) -> tuple[ir.Value, ir.Value]:
    """``Concat(past, new, axis=-2)`` consuming ``past`` -> (present, new)."""
    for node in consumers(past, "Concat"):
        if len(node.inputs) == 2 and node.inputs[0] is past and int_attr(node, "axis") in (-2, 2):
            return node.outputs[0], node.inputs[1]
    raise MatchFail(f"expected Concat({past.name}, new, axis=-2), found consumers {consumer_ops(past)}", past)


def _factor(value: ir.Value, node: ir.Node) -> float | None:
    """A one-element operand of a Mul / Div as a float: a constant, or folded from static shapes and constants
    (:func:`ortpa.rewriter._fold.fold_static`); a :class:`MatchFail` naming ``node`` when it is computed at run
    time from something that is not static (never a default in its place); None when it is not a scalar."""
    const = scalar(value)
    if const is not None:
        return const
    folded = fold_static(value)
    if folded is not None and folded.size == 1:
        return float(folded.reshape(()))
    need(
        not runtime_scalar(value),
        f"{node.op_type} by {value.name!r}, a factor computed at run time that is neither a constant nor "
        "foldable from static shapes: ortpa cannot read it as the attention's scale or softcap",
        node,
    )
    return None


def strip_scales(value: ir.Value, *, through_layout: bool = False) -> tuple[ir.Value, float]:
    """Walk back through Mul/Div by scalars (constants, or folded from static shapes) and Casts (and
    Reshape/Transpose when asked).

    Returns (base, factor): ``value == base * factor``. A Div by zero is not stripped; a scalar factor computed
    at run time raises :class:`MatchFail` naming its node.
    """
    factor = 1.0
    while True:
        node = producer_op(value, "Mul", "Div", "Reshape", "Transpose", "Cast")
        if node is None:
            return value, factor
        if node.op_type in ("Reshape", "Transpose"):
            if not through_layout:
                return value, factor
            value = node.inputs[0]
        elif node.op_type == "Cast":
            value = node.inputs[0]
        else:
            a, b = node.inputs[0], node.inputs[1]
            sb = _factor(b, node)
            sa = _factor(a, node) if sb is None else None
            if node.op_type == "Mul" and sb is not None:
                factor, value = factor * sb, a
            elif node.op_type == "Mul" and sa is not None:
                factor, value = factor * sa, b
            elif node.op_type == "Div" and sb is not None and sb != 0:
                factor, value = factor / sb, a
            else:
                return value, factor


def softmax_of(value: ir.Value) -> ir.Node | None:
    """The Softmax producing attention probabilities, through Where(IsNaN(p), 0, p), Cast and Dropout."""
    for _ in range(6):
        node = value.producer()
        if node is None:
            return None
        if node.op_type == "Softmax":
            return node
        if node.op_type in ("Cast", "Dropout"):
            value = node.inputs[0]
        elif node.op_type == "Where" and len(node.inputs) == 3:
            value = node.inputs[2]
        else:
            return None
    return None


def cache_layers(graph: ir.Graph) -> list[int]:
    """The layer indices ``i`` that have a ``past_key_values.{i}.key`` graph input, in order."""
    return sorted(
        int(v.name.split(".")[1])
        for v in graph.inputs
        if v.name and v.name.startswith("past_key_values.") and v.name.endswith(".key")
    )


def cache_inputs(graph: ir.Graph, i: int) -> tuple[ir.Value, ir.Value]:
    """Layer ``i``'s ``past_key_values.{i}.key`` and ``.value`` graph inputs; a :class:`MatchFail` if absent."""
    past_k = graph_input(graph, f"past_key_values.{i}.key")
    past_v = graph_input(graph, f"past_key_values.{i}.value")
    need(past_k is not None and past_v is not None, f"graph inputs past_key_values.{i}.key/.value not found", None)
    assert past_k is not None and past_v is not None
    return past_k, past_v


def reaches(start: ir.Value, target: ir.Value, max_nodes: int = 60) -> bool:
    """Whether ``target`` is among the non-constant values ``start`` is computed from (at most ``max_nodes``)."""
    seen: set[int] = set()
    queue = deque([start])
    while queue and len(seen) < max_nodes:
        value = queue.popleft()
        if value is target:
            return True
        node = value.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        queue.extend(v for v in node.inputs if v is not None and v.const_value is None)
    return False


def match_or_failure(match: Callable[[ir.Graph, int], T], graph: ir.Graph, layer: int) -> T | LayerFailure:
    """``match(graph, layer)``, or the :class:`LayerFailure` its :class:`MatchFail` describes."""
    try:
        return match(graph, layer)
    except MatchFail as fail:
        return LayerFailure(layer, fail.reason, fail.where)
