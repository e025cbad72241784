"""The kinds the per-sequence dataflow gives values (:mod:`ortpa.rewriter.per_sequence.flow`), and the state it
keeps: ranks, static dims (the dense batch symbol as 1), each value's kind."""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx_ir as ir

from ortpa.rewriter._graph import const_array, int_attr, ints_attr

__all__ = ["CONST", "COUNT", "Flow", "Kind", "lost", "norm", "step", "unknown_op"]


@dataclass(frozen=True)
class Kind:
    tag: str  # const | count | token | enum | route | step
    rank: int | None = None
    axis: int | None = None  # token / enum: the token axis
    sources: frozenset = frozenset()  # enum: the nodes whose packed indices it carries
    why: str | None = None  # step: how it mixes sequences
    node: ir.Node | None = None  # step: where; route: the node that regrouped the rows
    definite: bool = True  # step: False when the flow only lost track (an unknown op, rank or dim)
    block: int = 1  # token: rows per token on the token axis (a reshape folding [T, heads, d] into [T*heads, d])
    no_rule: bool = False  # step (not definite): an op the flow has no rule for, not merely a shape it cannot read
    # route (:mod:`ortpa.rewriter.per_sequence.routes`): what the value is to the sort ``node`` that regrouped its
    # rows ("rows", "perm", "meta", "seg", "segrows", "inverse"; "" for a regrouping nothing shows undone), how
    # many rows per token the sorted axis holds, and a segment's (start, end) bound values
    role: str = ""
    span: int = 1
    bounds: tuple = ()


CONST = Kind("const")
COUNT = Kind("count")


def step(node: ir.Node, why: str, definite: bool = True) -> Kind:
    return Kind("step", why=why, node=node, definite=definite)


def unknown_op(node: ir.Node, why: str) -> Kind:
    """An op the flow has no rule for: unknown is step-wide."""
    return Kind("step", why=why, node=node, definite=False, no_rule=True)


def lost(node: ir.Node, why: str) -> Kind:
    """The flow cannot follow the token axis here (a shape it cannot read): not shown to mix sequences, but
    refused where it reaches the logits or a cache, as unknown is step-wide."""
    return step(node, why, definite=False)


@dataclass
class Flow:
    kinds: dict[ir.Value, Kind] = field(default_factory=dict)
    batch: frozenset[str] = frozenset()  # the dense graph's batch dim symbols: 1 once tokens are packed
    dense: frozenset = frozenset()  # the dense graph's own nodes; the rewriter's others keep tokens as rows

    def dim(self, d) -> int | None:
        if isinstance(d, int):
            return d
        return 1 if isinstance(d, ir.SymbolicDim) and d.value in self.batch else None

    def dims(self, value: ir.Value, depth: int = 0) -> list[int | None] | None:
        """Static dims (batch symbols as 1), through the layout ops the rewriter builds without shapes."""
        if value.shape is not None:
            return [self.dim(d) for d in value.shape]
        node = value.producer()
        if node is None or depth > 8:
            return None
        if node.op_type in ("Cast", "Identity"):
            return self.dims(node.inputs[0], depth + 1)
        if node.op_type == "Transpose":
            inner = self.dims(node.inputs[0], depth + 1)
            if inner is None:
                return None
            perm = ints_attr(node, "perm") or list(reversed(range(len(inner))))
            return [inner[p] for p in perm]
        if node.op_type == "Unsqueeze" and len(node.inputs) > 1 and (axes := const_array(node.inputs[1])) is not None:
            inner = self.dims(node.inputs[0], depth + 1)
            if inner is None:
                return None
            out: list[int | None] = list(inner)
            for a in sorted(int(x) % (len(inner) + axes.size) for x in axes.reshape(-1)):
                out.insert(a, 1)
            return out
        if node.op_type == "MatMul":
            a, b = (self.dims(x, depth + 1) if x is not None else None for x in node.inputs[:2])
            if a is None or b is None or len(a) < 2 or len(b) < 2:
                return None
            batch_a, batch_b = a[:-2], b[:-2]
            width = max(len(batch_a), len(batch_b))
            batch_a = [1] * (width - len(batch_a)) + batch_a
            batch_b = [1] * (width - len(batch_b)) + batch_b
            pairs = zip(batch_a, batch_b, strict=True)
            batch = [x if y == 1 else y if x == 1 else (x if x == y else None) for x, y in pairs]
            return [*batch, a[-2], b[-1]]
        if node.op_type == "Reshape" and (target := const_array(node.inputs[1])) is not None:
            if 0 not in target.reshape(-1):
                return [int(t) if t > 0 else None for t in target.reshape(-1)]
        if node.op_type == "PagedAttention" and value is node.outputs[0]:
            heads = int_attr(node, "num_heads", 0)
            v_head = int_attr(node, "v_head_size", 0)
            cache = node.inputs[4] if len(node.inputs) > 4 and node.inputs[4] is not None else node.inputs[3]
            cache_dims = self.dims(cache, depth + 1) if cache is not None else None
            head = v_head or (cache_dims[3] if cache_dims and len(cache_dims) == 4 else None)
            return [None, heads * head if heads and head else None]
        return None

    def of(self, value: ir.Value | None) -> Kind:
        if value is None:
            return CONST
        return self.kinds.get(value, CONST)

    def rank(self, value: ir.Value | None) -> int | None:
        if value is None:
            return None
        kind = self.kinds.get(value)
        if kind is not None and kind.rank is not None:
            return kind.rank
        return None if value.shape is None else len(value.shape)

    def token_axis(self, value: ir.Value) -> int | None:
        kind = self.of(value)
        return kind.axis if kind.tag in ("token", "enum") else None


def norm(axis: int, rank: int | None) -> int | None:
    if rank is None:
        return axis if axis >= 0 else None
    return axis % rank if rank else 0
