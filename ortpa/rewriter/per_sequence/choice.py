"""A reduction across tokens whose result only decides a boolean choice -> per sequence (LongRoPE's long/short).

Packed, ``Where(ReduceMax(position_ids) + 1 > original_max, long, short)`` would take the max over every sequence of
the step. Here the reduction becomes a segment reduction (one value per sequence, from
``cumulative_sequence_lengths``, gathered back per token), the nodes from it to the condition run on those per-token
values, and the token-free nodes after the condition plus the first nodes with a per-token output are computed once
with the condition true and once false; a per-token ``Where`` then picks, so every token gets exactly (bit for bit)
what its sequence computes alone, and everything after the pick is computed once.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortpa.rewriter import packed
from ortpa.rewriter._graph import Builder
from ortpa.rewriter.per_sequence.axes import Live, TokenAxes, describe, reduced_axes

__all__ = ["SEGMENT_REDUCTIONS", "rewrite_choice"]

_SEGMENT_FILL = {"ReduceMax": "lowest", "ReduceMin": "highest", "ReduceSum": "zero", "ReduceMean": "zero"}
# Ops that act element by element (with broadcasting): a condition computed from the reduction through these is
# evaluated per token by running them on the per-token values.
_ELEMENTWISE = frozenset(
    {
        "Abs",
        "Add",
        "And",
        "Cast",
        "Ceil",
        "Div",
        "Equal",
        "Exp",
        "Floor",
        "Greater",
        "GreaterOrEqual",
        "Identity",
        "Less",
        "LessOrEqual",
        "Log",
        "Max",
        "Min",
        "Mod",
        "Mul",
        "Neg",
        "Not",
        "Or",
        "Pow",
        "Reciprocal",
        "Sqrt",
        "Sub",
        "Xor",
    }
)
_SCALAR_LAYOUT = frozenset({"Squeeze", "Unsqueeze", "Reshape", "Flatten"})  # on a one-element value: identity
SEGMENT_REDUCTIONS = frozenset(_SEGMENT_FILL)


def _descendants(start: ir.Value, live: Live) -> set[ir.Node]:
    out: set[ir.Node] = set()
    stack = [start]
    while stack:
        for node in live.consumers(stack.pop()):
            if node not in out:
                out.add(node)
                stack.extend(node.outputs)
    return out


def _ancestors_within(target: ir.Node, pool: set[ir.Node]) -> set[ir.Node]:
    out: set[ir.Node] = set()
    stack = [target]
    while stack:
        node = stack.pop()
        if node in out or node not in pool:
            continue
        out.add(node)
        stack.extend(x.producer() for x in node.inputs if x is not None and x.producer() is not None)
    return out


def rewrite_choice(
    io: packed.PagedIO,
    live: Live,
    axes: TokenAxes,
    b: Builder,
    reduction: ir.Node,
    done: list[str],
) -> str | None:
    """Make ``reduction`` per sequence when its result only feeds a boolean choice; the reason when not."""
    if reduction.op_type not in _SEGMENT_FILL:
        return f"{reduction.op_type} has no per-sequence form here (only {sorted(_SEGMENT_FILL)} do)"
    data, result = reduction.inputs[0], reduction.outputs[0]
    dims = axes.dims(data)
    token = axes.token_axes(data)
    reduced = set(reduced_axes(reduction, len(dims)) or [])
    kept = [i for i in range(len(dims)) if i not in reduced]
    if len(token) != 1 or any(dims[i] not in (1, axes.batch) for i in kept):
        return "it keeps axes other than batch, so its result is not one number per sequence"
    dtype = axes.dtype(data)
    if dtype is None:
        return "its input's element type is unknown"
    below = _descendants(result, live)
    condition = _find_condition(result, below, live, axes)
    if isinstance(condition, str):
        return condition
    cond_value, before = condition
    after, frontier, why = _after_condition(cond_value, live, axes)
    if why is not None:
        return why
    if not frontier:
        return "the choice it decides reaches no per-token value"

    per_token = _segment_reduce(b, io, reduction.op_type, data, dtype, len(dims), token[0])
    cond_tok = _clone_per_token(b, [n for n in live.order if n in before], result, per_token, cond_value)
    if isinstance(cond_tok, str):
        return cond_tok
    cond_tok = b.op("Reshape", [cond_tok, b.ints([-1])], hint="condition_per_token")
    selected = _select_per_token(b, live, after, frontier, cond_value, cond_tok, axes)
    if isinstance(selected, str):
        return selected
    done.append(
        f"{describe(reduction)}: {reduction.op_type} across tokens -> per sequence; condition "
        f"{cond_value.name!r} per token; {selected} per-token value(s) selected per token"
    )
    return None


def _find_condition(result: ir.Value, below: set[ir.Node], live: Live, axes: TokenAxes):
    """The first boolean value through which every use of ``result`` passes: ``(value, nodes from result to it)``."""
    for node in live.order:
        if node not in below:
            continue
        for cond in node.outputs:
            if cond.dtype != ir.DataType.BOOL or axes.token_free(cond) is not True:
                continue
            before = _ancestors_within(node, below)
            if _only_through(result, before, cond, live):
                return cond, before
    return (
        "its result is used as a number (not only through a boolean condition that picks between values), "
        "so the values computed from it cannot be selected per token"
    )


def _only_through(result: ir.Value, before: set[ir.Node], cond: ir.Value, live: Live) -> bool:
    """Every live use of ``result`` and of the values between it and ``cond`` stays inside ``before``."""
    values = [result] + [o for n in before for o in n.outputs if o is not cond]
    return all(c in before for v in values for c in live.consumers(v))


def _after_condition(cond: ir.Value, live: Live, axes: TokenAxes):
    """Token-free nodes computed from ``cond`` (``after``) and the first nodes with a per-token output."""
    after: list[ir.Node] = []
    frontier: list[ir.Node] = []
    stack, seen = [cond], set()
    while stack:
        for node in live.consumers(stack.pop()):
            if node in seen:
                continue
            seen.add(node)
            if any(attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS) for attr in node.attributes.values()):
                return after, frontier, f"the choice reaches {describe(node)}, which has subgraphs"
            kinds = {axes.token_free(o) for o in node.outputs}
            if None in kinds:
                return after, frontier, f"the choice reaches {describe(node)}, whose output shape is unknown"
            if kinds == {True}:
                after.append(node)
                stack.extend(node.outputs)
            else:
                frontier.append(node)
    order = {n: i for i, n in enumerate(live.order)}
    return sorted(after, key=order.__getitem__), sorted(frontier, key=order.__getitem__), None


def _segment_reduce(
    b: Builder, io: packed.PagedIO, op: str, data: ir.Value, dtype: ir.DataType, rank: int, token_axis: int
) -> ir.Value:
    """``[T]``: ``op`` over the elements of each token's own sequence, i.e. what the sequence computes alone."""
    per_token_op = "ReduceSum" if op == "ReduceMean" else op
    x = data
    others = [i for i in range(rank) if i != token_axis]
    if others:  # one number per token first; Mean: every token has as many elements, so mean of means is exact
        x = b.op(op, [x, b.ints(others)], {"keepdims": 1})
    x = b.op("Reshape", [x, b.ints([-1])])
    ts = packed.sequence_of_token(b, io)
    seq, onehot = ts.seq, ts.onehot
    np_dtype = dtype.numpy()
    info = np.finfo(np_dtype) if np.issubdtype(np_dtype, np.floating) else np.iinfo(np_dtype)
    fill = {"lowest": info.min, "highest": info.max, "zero": 0}[_SEGMENT_FILL[op]]
    filler = b.initializer(np.array(fill, np_dtype), "fill")
    masked = b.op("Where", [onehot, b.op("Unsqueeze", [x, b.ints([1])]), filler])
    per_seq = b.op(per_token_op, [masked, b.ints([0])], {"keepdims": 0})
    if op == "ReduceMean":
        count = b.op("ReduceSum", [b.op("Cast", [onehot], {"to": dtype}), b.ints([0])], {"keepdims": 0})
        per_seq = b.op("Div", [per_seq, count])
    out = b.op("Gather", [per_seq, seq], {"axis": 0}, hint="per_sequence")
    io.per_token[out] = (1, 0)
    return out


def _clone_per_token(
    b: Builder, before: list[ir.Node], result: ir.Value, per_token: ir.Value, cond: ir.Value
) -> ir.Value | str:
    """Re-run the nodes from ``result`` to ``cond`` on the per-token values ``[T]``: the condition per token."""
    mapping: dict[ir.Value, ir.Value] = {result: per_token}
    for node in before:  # in topological order
        if node.domain not in ("", "ai.onnx") or not (node.op_type in _ELEMENTWISE or node.op_type in _SCALAR_LAYOUT):
            return f"the condition is computed with {describe(node)}, which does not act element by element"
        for x in node.inputs:
            if x is None or x in mapping:
                continue
            size = None if x.shape is None or not x.shape.is_static() else int(np.prod(x.shape.numpy()))
            if size != 1:
                return f"{describe(node)} combines it with {x.name!r}, which is not a single number"
        if node.op_type in _SCALAR_LAYOUT:  # layout of a one-element value: keep the per-token vector as is
            mapping[node.outputs[0]] = mapping[node.inputs[0]]
            continue
        attrs = {k: a.value for k, a in node.attributes.items()}
        out = b.op(node.op_type, [mapping.get(x, x) for x in node.inputs], attrs, hint=node.op_type + "_per_token")
        mapping[node.outputs[0]] = out
    return mapping[cond]


def _select_per_token(
    b: Builder,
    live: Live,
    after: list[ir.Node],
    frontier: list[ir.Node],
    cond: ir.Value,
    cond_tok: ir.Value,
    axes: TokenAxes,
) -> int | str:
    """Compute ``after`` + ``frontier`` for cond = True and for cond = False, then pick per token."""
    if cond.shape is None or not cond.shape.is_static():
        return f"the condition {cond.name!r} has no static shape"
    outputs = [o for n in frontier for o in n.outputs if live.consumers(o) or o.is_graph_output()]
    for o in outputs:
        token = axes.token_axes(o)
        if token is None or len(token) != 1:
            return f"{o.name!r} does not have exactly one token axis"
    if any(o.is_graph_output() for n in after for o in n.outputs):
        return "a value computed from the condition is a graph output"
    branches = []
    for flag in (True, False):
        mapping = {cond: b.initializer(np.full(cond.shape.numpy(), flag), f"condition_{str(flag).lower()}")}
        for node in after + frontier:
            attrs = {k: a.value for k, a in node.attributes.items()}
            clone = b.op(
                node.op_type,
                [mapping.get(x, x) if x is not None else None for x in node.inputs],
                attrs,
                domain=node.domain,
                num_outputs=len(node.outputs),
                hint=f"{node.op_type}_if_{str(flag).lower()}",
            )
            for old, new in zip(node.outputs, clone if isinstance(clone, tuple) else (clone,), strict=True):
                new.type, new.shape = old.type, old.shape  # same inputs' shapes: the flow follows the copies too
                mapping[old] = new
        branches.append(mapping)
    for o in outputs:
        (k,) = axes.token_axes(o)
        trailing = axes.rank(o) - k - 1
        c = b.op("Reshape", [cond_tok, b.ints([-1] + [1] * trailing)]) if trailing else cond_tok
        picked = b.op("Where", [c, branches[0][o], branches[1][o]], hint="per_token_choice")
        picked.type, picked.shape = o.type, o.shape
        o.replace_all_uses_with(picked, replace_graph_outputs=True)
    return len(outputs)
