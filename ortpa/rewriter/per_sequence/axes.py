"""Which axis of a value is the token axis, and which nodes still reach the converted graph's outputs.

Shared by :mod:`ortpa.rewriter.per_sequence` and :mod:`ortpa.rewriter.per_sequence.choice`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from ortpa.rewriter import packed
from ortpa.rewriter._graph import const_array, int_attr, ints_attr

__all__ = ["Dim", "Live", "TokenAxes", "describe", "live_nodes", "reduced_axes", "sym", "token_axes_of"]

Dim = int | str | None  # a number, a symbol, or unknown


@dataclass
class TokenAxes:
    """Which axis of a value is the token axis: the dense ``input_ids``' ``seq`` symbol, or ``num_tokens``.

    Values the rewriter built (the packed ``input_ids`` / positions, and what reads them) carry no shape;
    :meth:`dims` follows them through the few ops that ``paged_io`` puts between them and the dense graph.
    """

    tokens: frozenset[str]
    batch: str | None
    known: dict[ir.Value, list[Dim]] = field(default_factory=dict)

    def dims(self, value: ir.Value | None, depth: int = 0) -> list[Dim] | None:
        """The value's dims; unknown ones filled in from its producer's input where the op says how."""
        if value is None:
            return None
        if value in self.known:
            return self.known[value]
        stored = None if value.shape is None else [d if isinstance(d, int) else sym(d) for d in value.shape]
        if stored is not None and None not in stored:
            return stored
        inferred = self._inferred(value, depth)
        if stored is None or inferred is None or len(inferred) != len(stored):
            return stored if inferred is None else inferred
        return [s if s is not None else i for s, i in zip(stored, inferred, strict=True)]

    def _inferred(self, value: ir.Value, depth: int) -> list[Dim] | None:
        node = value.producer()
        if node is None or depth > 8 or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type in ("Cast", "Identity"):
            return self.dims(node.inputs[0], depth + 1)
        if node.op_type == "Unsqueeze" and len(node.inputs) > 1:
            inner, where = self.dims(node.inputs[0], depth + 1), const_array(node.inputs[1])
            if inner is None or where is None:
                return None
            out: list[Dim] = list(inner)
            for a in sorted(int(x) % (len(inner) + where.size) for x in where.reshape(-1)):
                out.insert(a, 1)
            return out
        return None

    def dtype(self, value: ir.Value | None, depth: int = 0) -> ir.DataType | None:
        if value is None or value.dtype is not None or depth > 8:
            return None if value is None else value.dtype
        if value in self.known:
            return ir.DataType.INT64
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx"):
            return None
        if node.op_type == "Cast":
            return ir.DataType(int_attr(node, "to"))
        if node.op_type in ("Identity", "Unsqueeze", "Squeeze", "Reshape"):
            return self.dtype(node.inputs[0], depth + 1)
        return None

    def token_axes(self, value: ir.Value) -> list[int] | None:
        """Axes of ``value`` whose dim is the token symbol; None when its shape is unknown."""
        dims = self.dims(value)
        return None if dims is None else [i for i, d in enumerate(dims) if d in self.tokens]

    def token_free(self, value: ir.Value) -> bool | None:
        """True when ``value`` has no token axis, False when it has one, None when its shape cannot say."""
        dims = self.dims(value)
        if dims is None:
            return None
        if any(d in self.tokens for d in dims):
            return False
        return None if any(d is None for d in dims) else True

    def rank(self, value: ir.Value) -> int | None:
        dims = self.dims(value)
        return None if dims is None else len(dims)


def sym(dim) -> str | None:
    return dim.value if isinstance(dim, ir.SymbolicDim) else None


def describe(node: ir.Node) -> str:
    return f"{node.op_type} node {node.name or '?'!r}"


@dataclass
class Live:
    """The nodes that still reach the converted graph's outputs, in topological order."""

    order: list[ir.Node] = field(default_factory=list)
    nodes: set[ir.Node] = field(default_factory=set)

    def consumers(self, value: ir.Value) -> list[ir.Node]:
        seen: list[ir.Node] = []
        for node in value.consumers():
            if node in self.nodes and node not in seen:
                seen.append(node)
        return seen


def live_nodes(graph: ir.Graph, io: packed.PagedIO) -> Live:
    """Nodes reaching the outputs that survive :func:`paged_io.finish`: the dense logits and the new outputs.

    The dense ``present.*`` outputs (and the dense attention feeding them) are still graph outputs at this point
    but go away in ``finish``, so they do not count.
    """
    dense = set(io.dense_outputs.values())
    roots = [v for v in graph.outputs if v not in dense]
    if "logits" in io.dense_outputs:
        roots.append(io.dense_outputs["logits"])
    live = Live()
    visiting: set[ir.Node] = set()
    stack: list[tuple[ir.Node, bool]] = [(v.producer(), False) for v in reversed(roots) if v.producer() is not None]
    while stack:  # iterative DFS post-order: deep graphs must not hit the recursion limit
        node, expanded = stack.pop()
        if node in live.nodes:
            continue
        if expanded:
            live.nodes.add(node)
            live.order.append(node)
            continue
        if node in visiting:
            continue
        visiting.add(node)
        stack.append((node, True))
        for value in reversed(list(node.inputs)):
            producer = value.producer() if value is not None else None
            if producer is not None and producer not in live.nodes:
                stack.append((producer, False))
    return live


def token_axes_of(io: packed.PagedIO) -> TokenAxes | None:
    ids = io.dense_inputs.get("input_ids")
    if ids is None or ids.shape is None or len(ids.shape) != 2:
        return None
    token = sym(ids.shape[1])
    if token is None:
        return None
    known: dict[ir.Value, list[Dim]] = {value: ["num_tokens"] for value, (rank, _) in io.seeds().items() if rank == 1}
    return TokenAxes(frozenset({token, "num_tokens"}), sym(ids.shape[0]), known)


def reduced_axes(node: ir.Node, rank: int) -> list[int] | None:
    """The axes a reduction node reduces (normalised), or None when they are not constant."""
    if node.op_type in ("ArgMax", "ArgMin"):
        axes = [int_attr(node, "axis", 0)]
    elif node.op_type == "TopK":
        axes = [int_attr(node, "axis", -1)]
    elif node.op_type == "CumSum":
        arr = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
        if arr is None:
            return None
        axes = [int(arr.reshape(-1)[0])]
    else:
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            arr = const_array(node.inputs[1])
            if arr is None:
                return None
            axes = [int(a) for a in arr.reshape(-1)]
        else:
            axes = ints_attr(node, "axes") or []
        if not axes:
            return [] if int_attr(node, "noop_with_empty_axes", 0) else list(range(rank))
    return sorted({a % rank for a in axes}) if rank else []
