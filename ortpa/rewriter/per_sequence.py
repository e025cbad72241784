"""Values a packed graph computes over the whole step -> what each sequence computes alone, or a refusal.

The converted graph runs every sequence's new tokens as one row (batch 1, seq = num_tokens; see
:mod:`ortpa.rewriter.paged_io`). A value the dense graph reduced over its seq axis then covers every sequence of
the step, while the same sequence run alone sees only its own tokens: LongRoPE (Phi-3.5, Phi-3-128k) chooses
its long or short factors with ``Where(ReduceMax(position_ids) + 1 > original_max_position_embeddings, long,
short)``, so a short prompt packed with a long one would get the long factors. :func:`per_sequence_reductions`
finds, among the nodes that still reach an output, every reduction across the token axis and every token
count read with ``Shape`` and used as a number, and

* rewrites a reduction (Max / Min / Sum / Mean) of a per-token scalar whose result only decides a boolean
  choice: the reduction becomes a segment reduction (one value per sequence, gathered back per token), the
  condition is evaluated per token, and the nodes between the condition and the first per-token values are
  computed for both outcomes and selected per token. Selection is exact: each token gets bit for bit what
  its sequence computes alone, and the per-token subgraph after the selection is computed once;
* replaces ``past_len + Range(0, seq)`` positions, ``past_len`` read from ``Shape`` of a dense cache input
  (transformers 5.x ``OnnxExporter`` decode models), with the packed positions;
* refuses everything else with a :class:`~ortpa.errors.ConversionError` naming the node and the reason.

Graphs without such values are left untouched (no node is added, none is reordered).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from ortpa.errors import ConversionError
from ortpa.rewriter import paged_io
from ortpa.rewriter._graph import Builder, const_array, int_attr, ints_attr

__all__ = ["TOKEN_REDUCTIONS", "per_sequence_reductions"]

# Reductions that mix tokens when their axes include the token axis; the first four are made per-sequence.
TOKEN_REDUCTIONS = frozenset(
    {
        "ReduceMax",
        "ReduceMin",
        "ReduceSum",
        "ReduceMean",
        "ReduceProd",
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceSumSquare",
        "ArgMax",
        "ArgMin",
        "CumSum",
        "TopK",
    }
)
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
# A token count read with Shape may size a tensor; any other use treats the packed count as the sequence's own.
_SHAPE_ARGUMENTS = {
    "Reshape": {1},
    "Expand": {1},
    "ConstantOfShape": {0},
    "Tile": {1},
    "Slice": {1, 2, 3, 4},
    "Pad": {1},
    "Split": {1},
    "Resize": {3},
}
_COUNT_ARITHMETIC = frozenset(
    {"Add", "Sub", "Mul", "Div", "Cast", "Concat", "Gather", "Slice", "Squeeze", "Unsqueeze", "Reshape", "Identity"}
)


Dim = int | str | None  # a number, a symbol, or unknown


@dataclass
class _Axes:
    """Which axis of a value is the token axis: the dense ``input_ids``' ``seq`` symbol, or ``num_tokens``.

    Values the rewriter built (the packed ``input_ids`` / positions, and what reads them) carry no shape;
    :meth:`dims` follows them through the few ops that ``paged_io`` puts between them and the dense graph.
    """

    tokens: frozenset[str]
    batch: str | None
    known: dict[ir.Value, list[Dim]] = field(default_factory=dict)

    def dims(self, value: ir.Value | None, depth: int = 0) -> list[Dim] | None:
        if value is None:
            return None
        if value.shape is not None:
            return [d if isinstance(d, int) else _sym(d) for d in value.shape]
        if value in self.known:
            return self.known[value]
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


def _sym(dim) -> str | None:
    return dim.value if isinstance(dim, ir.SymbolicDim) else None


def _where(node: ir.Node) -> str:
    return f"{node.op_type} node {node.name or '?'!r}"


@dataclass
class _Live:
    """The nodes that still reach the converted graph's outputs, in topological order."""

    order: list[ir.Node] = field(default_factory=list)
    nodes: set[ir.Node] = field(default_factory=set)

    def consumers(self, value: ir.Value) -> list[ir.Node]:
        seen: list[ir.Node] = []
        for node in value.consumers():
            if node in self.nodes and node not in seen:
                seen.append(node)
        return seen


def _live_nodes(graph: ir.Graph, io: paged_io.PagedIO) -> _Live:
    """Nodes reaching the outputs that survive :func:`paged_io.finish`: the dense logits and the new outputs.

    The dense ``present.*`` outputs (and the dense attention feeding them) are still graph outputs at this point
    but go away in ``finish``, so they do not count.
    """
    dense = set(io.dense_outputs.values())
    roots = [v for v in graph.outputs if v not in dense]
    if "logits" in io.dense_outputs:
        roots.append(io.dense_outputs["logits"])
    live = _Live()
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


def _axes_of(io: paged_io.PagedIO) -> _Axes | None:
    ids = io.dense_inputs.get("input_ids")
    if ids is None or ids.shape is None or len(ids.shape) != 2:
        return None
    token = _sym(ids.shape[1])
    if token is None:
        return None
    known: dict[ir.Value, list[Dim]] = {io.input_ids: ["num_tokens"]}
    for value in (io.position_ids, io.derived_positions):
        if value is not None:
            known[value] = ["num_tokens"]
    return _Axes(frozenset({token, "num_tokens"}), _sym(ids.shape[0]), known)


def _reduced_axes(node: ir.Node, rank: int) -> list[int] | None:
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


def _token_reductions(live: _Live, axes: _Axes) -> list[tuple[ir.Node, str | None]]:
    """Reductions across the token axis: ``(node, None)`` when understood, ``(node, why)`` when it cannot tell."""
    found: list[tuple[ir.Node, str | None]] = []
    for node in live.order:
        if node.domain not in ("", "ai.onnx") or node.op_type not in TOKEN_REDUCTIONS:
            continue
        data = node.inputs[0]
        token = axes.token_axes(data)
        if token is None:  # e.g. values built by the rewriter carry no shape
            if _from_tokens(data, axes):
                found.append((node, "its input's shape is unknown, so whether it reduces across tokens is not known"))
            continue
        if not token:
            continue
        reduced = _reduced_axes(node, len(axes.dims(data)))
        if reduced is None:
            found.append((node, "its axes are not constant"))
        elif set(reduced) & set(token):
            found.append((node, None))
    return found


def _from_tokens(value: ir.Value, axes: _Axes, limit: int = 64) -> bool:
    """Whether ``value`` is computed from a value with a token axis (a short backward walk; Shape stops it)."""
    stack, seen = [value], set()
    while stack and len(seen) < limit:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if axes.token_axes(v):
            return True
        node = v.producer()
        if node is None or node.op_type in ("Shape", "Size"):
            continue
        stack.extend(x for x in node.inputs if x is not None)
    return False


def per_sequence_reductions(graph: ir.Graph, io: paged_io.PagedIO) -> list[str]:
    """Make every step-wide value of the packed ``graph`` per sequence; one line per rewrite.

    Called by :func:`paged_io.finish` once the dense ``position_ids`` uses read the packed positions. Raises
    :class:`ConversionError` listing each node that mixes the sequences of a step and cannot be rewritten.
    """
    axes = _axes_of(io)
    if axes is None:  # no symbolic token axis: nothing in the graph can be told apart as per-token
        return []
    live = _live_nodes(graph, io)
    done: list[str] = []
    failures: list[tuple[str, str]] = []
    b = Builder(graph, "/per_sequence")
    done += _replace_past_length_positions(graph, io, live, axes, b)
    if done:
        live = _live_nodes(graph, io)
    for node, why in _token_reductions(live, axes):
        if why is None:
            why = _rewrite_choice(graph, io, live, axes, b, node, done)
        if why is not None:
            failures.append((_where(node), f"reduces across the tokens of every sequence in the step: {why}"))
    failures += _token_counts(live, axes)
    if failures:
        raise ConversionError(
            "values computed over the whole packed step (every sequence's tokens) cannot be made per sequence; "
            "batched results would differ from each sequence run alone",
            failures,
        )
    return done


# -- token counts read with Shape ---------------------------------------------------------------------------------


def _count_sources(live: _Live, axes: _Axes) -> list[ir.Value]:
    """Outputs of live ``Shape``/``Size`` nodes of the dense graph that read the token count.

    Shapes of the paged inputs themselves are the rewriter's own packed-aware index arithmetic.
    """
    out = []
    for node in live.order:
        if node.inputs and node.inputs[0] in axes.known:
            continue
        if node.op_type == "Size" and axes.token_axes(node.inputs[0]):
            out.append(node.outputs[0])
        elif node.op_type == "Shape":
            token = axes.token_axes(node.inputs[0])
            if not token:
                continue
            rank = axes.rank(node.inputs[0])
            start, end = int_attr(node, "start", 0), int_attr(node, "end", rank)
            if set(range(rank)[slice(start, end)]) & set(token):
                out.append(node.outputs[0])
    return out


def _token_counts(live: _Live, axes: _Axes) -> list[tuple[str, str]]:
    """The packed token count used as a number (not as a size): the sequence alone would see its own count."""
    failures = []
    reported: set[ir.Node] = set()
    stack = _count_sources(live, axes)
    seen: set[ir.Value] = set()
    while stack:
        value = stack.pop()
        if value in seen:
            continue
        seen.add(value)
        for node in live.consumers(value):
            slots = {i for i, x in enumerate(node.inputs) if x is value}
            if slots <= _SHAPE_ARGUMENTS.get(node.op_type, set()):
                continue
            if node.op_type in _COUNT_ARITHMETIC and _shape_like(node, slots, axes):
                stack.extend(node.outputs)
            elif node not in reported:
                reported.add(node)
                failures.append(
                    (
                        _where(node),
                        "uses the number of tokens in the step (read with Shape) as a value; alone, a sequence "
                        "would see its own token count",
                    )
                )
    return failures


def _shape_like(node: ir.Node, slots: set[int], axes: _Axes) -> bool:
    """Integer arithmetic on shapes (``seq * heads``, a Concat of dims): the count stays a size, not a value."""
    if node.op_type == "Gather" and 1 in slots:  # indexing with the count
        return False
    out = node.outputs[0]
    dims = axes.dims(out)
    dtype = axes.dtype(out)
    return dtype in (ir.DataType.INT64, ir.DataType.INT32) and dims is not None and len(dims) <= 1


# -- positions = past_len + Range(0, seq) ------------------------------------------------------------------------


def _dim_read(value: ir.Value | None, axes: _Axes) -> tuple[ir.Value, int] | None:
    """``(tensor, axis)`` when ``value`` is one dim of ``tensor`` read with Shape (through Squeeze/Gather/Cast)."""
    while value is not None and (node := value.producer()) is not None:
        if node.op_type in ("Squeeze", "Cast", "Reshape", "Unsqueeze", "Identity"):
            value = node.inputs[0]
            continue
        offset = 0
        if node.op_type == "Gather":
            idx = const_array(node.inputs[1])
            if idx is None or idx.size != 1 or node.inputs[0].producer() is None:
                return None
            offset, node = int(idx.reshape(-1)[0]), node.inputs[0].producer()
        if node.op_type != "Shape":
            return None
        rank = axes.rank(node.inputs[0])
        if rank is None:
            return None
        picked = list(range(rank))[slice(int_attr(node, "start", 0), int_attr(node, "end", rank))]
        if node is not value.producer() and -len(picked) <= offset < len(picked):  # Gather(Shape(x), i)
            return node.inputs[0], picked[offset]
        return (node.inputs[0], picked[0]) if len(picked) == 1 else None
    return None


def _replace_past_length_positions(
    graph: ir.Graph, io: paged_io.PagedIO, live: _Live, axes: _Axes, b: Builder
) -> list[str]:
    """``Add(Range(0, seq, 1), past_len)`` or ``Range(past_len, past_len + seq, 1)`` -> the packed positions.

    ``past_len`` is dim 2 of a dense ``[batch, heads, past, head]`` cache input read with Shape, ``seq`` the
    token axis of a dense input: what a decode model without a ``position_ids`` input uses as positions.
    """

    dense = set(io.dense_inputs.values())

    def is_past(value: ir.Value) -> bool:  # dim 2 of a dense [batch, heads, past, head] cache input
        read = _dim_read(value, axes)
        return read is not None and read[0] in dense and axes.rank(read[0]) == 4 and read[1] == 2

    def is_seq(value: ir.Value) -> bool:  # the token axis of any per-token tensor
        read = _dim_read(value, axes)
        return read is not None and read[1] in (axes.token_axes(read[0]) or [])

    def zero_one(value: ir.Value | None, want: int) -> bool:
        arr = const_array(value)
        return arr is not None and arr.size == 1 and int(arr.reshape(-1)[0]) == want

    done = []
    for node in list(live.order):
        if node.op_type != "Range":
            continue
        start, limit, delta = node.inputs
        out: ir.Value | None = None
        if zero_one(start, 0) and zero_one(delta, 1) and is_seq(limit):
            for add in live.consumers(node.outputs[0]):
                other = [x for x in add.inputs if x is not node.outputs[0]]
                if add.op_type == "Add" and len(other) == 1 and is_past(other[0]):
                    out = add.outputs[0]
                    break
        elif zero_one(delta, 1) and is_past(start):
            total = limit.producer()
            if total is not None and total.op_type == "Add" and {is_past(x) for x in total.inputs} == {True, False}:
                if any(is_seq(x) for x in total.inputs):
                    out = node.outputs[0]
        if out is None:
            continue
        pos = paged_io.positions(b, io)
        if out.dtype not in (None, ir.DataType.INT64):
            pos = b.op("Cast", [pos], {"to": out.dtype})
        out.replace_all_uses_with(pos)
        done.append(f"{_where(node)}: past length (Shape of a dense cache) + Range(seq) -> packed positions")
    return done


# -- reductions that decide a boolean choice ----------------------------------------------------------------------


def _descendants(start: ir.Value, live: _Live) -> set[ir.Node]:
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


def _rewrite_choice(
    graph: ir.Graph,
    io: paged_io.PagedIO,
    live: _Live,
    axes: _Axes,
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
    reduced = set(_reduced_axes(reduction, len(dims)) or [])
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
    cond_tok = _clone_per_token(b, before, result, per_token, cond_value)
    if isinstance(cond_tok, str):
        return cond_tok
    cond_tok = b.op("Reshape", [cond_tok, b.ints([-1])], hint="condition_per_token")
    selected = _select_per_token(b, live, after, frontier, cond_value, cond_tok, axes)
    if isinstance(selected, str):
        return selected
    done.append(
        f"{_where(reduction)}: {reduction.op_type} across tokens -> per sequence; condition "
        f"{cond_value.name!r} per token; {selected} per-token value(s) selected per token"
    )
    return None


def _find_condition(result: ir.Value, below: set[ir.Node], live: _Live, axes: _Axes):
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


def _only_through(result: ir.Value, before: set[ir.Node], cond: ir.Value, live: _Live) -> bool:
    """Every live use of ``result`` and of the values between it and ``cond`` stays inside ``before``."""
    values = [result] + [o for n in before for o in n.outputs if o is not cond]
    return all(c in before for v in values for c in live.consumers(v))


def _after_condition(cond: ir.Value, live: _Live, axes: _Axes):
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
                return after, frontier, f"the choice reaches {_where(node)}, which has subgraphs"
            kinds = {axes.token_free(o) for o in node.outputs}
            if None in kinds:
                return after, frontier, f"the choice reaches {_where(node)}, whose output shape is unknown"
            if kinds == {True}:
                after.append(node)
                stack.extend(node.outputs)
            else:
                frontier.append(node)
    order = {n: i for i, n in enumerate(live.order)}
    return sorted(after, key=order.__getitem__), sorted(frontier, key=order.__getitem__), None


def _sequence_of_token(b: Builder, io: paged_io.PagedIO) -> tuple[ir.Value, ir.Value]:
    """``(seq, onehot)``: the sequence owning each packed token ``[T]`` and ``onehot[t, s] = seq[t] == s``.

    Mirrors :func:`paged_io.positions`: seq(t) = #{s : cu[s+1] <= t}.
    """
    zero, one = b.initializer(np.array(0, np.int64), "zero"), b.initializer(np.array(1, np.int64), "one")
    t = b.op("Range", [zero, b.op("Squeeze", [b.op("Shape", [io.input_ids])]), one])
    cu = b.op("Cast", [io.cumulative_sequence_lengths], {"to": ir.DataType.INT64})
    ends = b.op("Slice", [cu, b.ints([1]), b.ints([np.iinfo(np.int64).max])])
    le = b.op("LessOrEqual", [b.op("Unsqueeze", [ends, b.ints([0])]), b.op("Unsqueeze", [t, b.ints([1])])])
    seq = b.op("ReduceSum", [b.op("Cast", [le], {"to": ir.DataType.INT64}), b.ints([1])], {"keepdims": 0})
    batch = b.op("Squeeze", [b.op("Shape", [io.past_sequence_lengths])])
    sequences = b.op("Range", [zero, batch, one])
    onehot = b.op("Equal", [b.op("Unsqueeze", [seq, b.ints([1])]), b.op("Unsqueeze", [sequences, b.ints([0])])])
    return seq, onehot


def _segment_reduce(
    b: Builder, io: paged_io.PagedIO, op: str, data: ir.Value, dtype: ir.DataType, rank: int, token_axis: int
) -> ir.Value:
    """``[T]``: ``op`` over the elements of each token's own sequence, i.e. what the sequence computes alone."""
    per_token_op = "ReduceSum" if op == "ReduceMean" else op
    x = data
    others = [i for i in range(rank) if i != token_axis]
    if others:  # one number per token first; Mean: every token has as many elements, so mean of means is exact
        x = b.op(op, [x, b.ints(others)], {"keepdims": 1})
    x = b.op("Reshape", [x, b.ints([-1])])
    seq, onehot = _sequence_of_token(b, io)
    np_dtype = dtype.numpy()
    info = np.finfo(np_dtype) if np.issubdtype(np_dtype, np.floating) else np.iinfo(np_dtype)
    fill = {"lowest": info.min, "highest": info.max, "zero": 0}[_SEGMENT_FILL[op]]
    filler = b.initializer(np.array(fill, np_dtype), "fill")
    masked = b.op("Where", [onehot, b.op("Unsqueeze", [x, b.ints([1])]), filler])
    per_seq = b.op(per_token_op, [masked, b.ints([0])], {"keepdims": 0})
    if op == "ReduceMean":
        count = b.op("ReduceSum", [b.op("Cast", [onehot], {"to": dtype}), b.ints([0])], {"keepdims": 0})
        per_seq = b.op("Div", [per_seq, count])
    return b.op("Gather", [per_seq, seq], {"axis": 0}, hint="per_sequence")


def _clone_per_token(
    b: Builder, before: set[ir.Node], result: ir.Value, per_token: ir.Value, cond: ir.Value
) -> ir.Value | str:
    """Re-run the nodes from ``result`` to ``cond`` on the per-token values ``[T]``: the condition per token."""
    mapping: dict[ir.Value, ir.Value] = {result: per_token}
    for node in _topo(before):
        if node.domain not in ("", "ai.onnx") or not (node.op_type in _ELEMENTWISE or node.op_type in _SCALAR_LAYOUT):
            return f"the condition is computed with {_where(node)}, which does not act element by element"
        for x in node.inputs:
            if x is None or x in mapping:
                continue
            size = None if x.shape is None or not x.shape.is_static() else int(np.prod(x.shape.numpy()))
            if size != 1:
                return f"{_where(node)} combines it with {x.name!r}, which is not a single number"
        if node.op_type in _SCALAR_LAYOUT:  # layout of a one-element value: keep the per-token vector as is
            mapping[node.outputs[0]] = mapping[node.inputs[0]]
            continue
        attrs = {k: a.value for k, a in node.attributes.items()}
        out = b.op(node.op_type, [mapping.get(x, x) for x in node.inputs], attrs, hint=node.op_type + "_per_token")
        mapping[node.outputs[0]] = out
    return mapping[cond]


def _topo(nodes: Iterable[ir.Node]) -> list[ir.Node]:
    pool = set(nodes)
    order: list[ir.Node] = []
    placed: set[ir.Node] = set()

    def visit(node: ir.Node) -> None:
        if node in placed or node not in pool:
            return
        placed.add(node)
        for x in node.inputs:
            if x is not None and x.producer() is not None:
                visit(x.producer())
        order.append(node)

    for node in pool:
        visit(node)
    return order


def _select_per_token(
    b: Builder,
    live: _Live,
    after: list[ir.Node],
    frontier: list[ir.Node],
    cond: ir.Value,
    cond_tok: ir.Value,
    axes: _Axes,
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
