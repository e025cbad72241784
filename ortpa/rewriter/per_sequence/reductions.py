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
  its sequence computes alone, and the per-token subgraph after the selection is computed once
  (:mod:`ortpa.rewriter.per_sequence.choice`);
* replaces ``past_len + Range(0, seq)``, ``past_len`` read with ``Shape`` from a dense cache input, with the packed
  positions: transformers' ``cache_position``, which is the positions of models that take no ``position_ids``
  (the 5.x ``OnnxExporter`` decode models take ``position_ids``; there it feeds only the causal mask);
* makes LongRoPE's ``If``-chosen tables of ``com.microsoft::RotaryEmbedding`` per token
  (:mod:`ortpa.rewriter.per_sequence.rope_choice`);
* then runs the dataflow (:mod:`ortpa.rewriter.per_sequence.flow`, from op semantics and shapes, never names) and
  its segment rewrites (:mod:`ortpa.rewriter.per_sequence.segments`: per-sequence ``Range``, last / first token,
  reductions broadcast back, ``CumSum``); a reduction the choice rewrite above cannot take is left to them;
* refuses everything else with a :class:`~ortpa.errors.ConversionError` naming the node and the reason.

Runs in the pipeline between :func:`ortpa.rewriter.paged_io.route` and :func:`ortpa.rewriter.paged_io.finish`.
Graphs without such values are left untouched (no node is added, none is reordered).
"""

from __future__ import annotations

import onnx_ir as ir

from ortpa.errors import ConversionError
from ortpa.rewriter import packed
from ortpa.rewriter._graph import Builder, const_array, int_attr
from ortpa.rewriter.per_sequence import rope_choice
from ortpa.rewriter.per_sequence.axes import Live, TokenAxes, describe, live_nodes, reduced_axes, token_axes_of
from ortpa.rewriter.per_sequence.choice import rewrite_choice
from ortpa.rewriter.per_sequence.segments import flow_rewrites

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
    {
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Cast",
        "Concat",
        "Gather",
        "Slice",
        "Squeeze",
        "Unsqueeze",
        "Reshape",
        "Identity",
        "Equal",
        "Where",
    }
)


def _token_reductions(live: Live, axes: TokenAxes) -> list[tuple[ir.Node, str | None]]:
    """Reductions across the token axis: ``(node, None)`` when understood, ``(node, why)`` when not rewritable.

    Where shapes are partly unknown (exporters leave some dims unnamed), only a reduction over every axis of a
    value computed from the tokens is sure to cross them; a reduction over some axes of unknown size (a q/k norm
    over an unnamed head dim) is taken to be per token.
    """
    found: list[tuple[ir.Node, str | None]] = []
    for node in live.order:
        if node.domain not in ("", "ai.onnx") or node.op_type not in TOKEN_REDUCTIONS:
            continue
        data = node.inputs[0]
        dims = axes.dims(data)
        if dims is None:  # unknown rank (values built by the rewriter carry no shape)
            if _reduces_everything(node) and _from_tokens(data, axes):
                found.append((node, "it reduces every axis of values computed from the tokens, of unknown shape"))
            continue
        token = axes.token_axes(data) or []
        reduced = reduced_axes(node, len(dims))
        if reduced is None:
            if token:
                found.append((node, "its axes are not constant"))
        elif set(reduced) & set(token):
            found.append((node, None))
        elif len(reduced) == len(dims) and None in dims and node.op_type != "TopK" and _from_tokens(data, axes):
            # (a TopK the flow follows by kinds: a sort of every row, or a pick of some rows named there)
            found.append((node, "it reduces every axis of values computed from the tokens; which is theirs is unknown"))
    return found


def _reduces_everything(node: ir.Node) -> bool:
    """A Reduce* with no axes (input or attribute) that does reduce: every axis, whatever the rank."""
    if not node.op_type.startswith("Reduce") or int_attr(node, "noop_with_empty_axes", 0):
        return False
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        arr = const_array(node.inputs[1])
        return arr is not None and arr.size == 0
    return not node.attributes.get("axes")


def _from_tokens(value: ir.Value, axes: TokenAxes, limit: int = 64) -> bool:
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


def per_sequence_reductions(graph: ir.Graph, io: packed.PagedIO) -> list[str]:
    """Make every step-wide value of the packed ``graph`` per sequence; one line per rewrite.

    Called by the pipeline between :func:`paged_io.route` (the dense ``position_ids`` uses read the packed
    positions) and :func:`paged_io.finish`. Raises
    :class:`ConversionError` listing each node that mixes the sequences of a step and cannot be rewritten.
    """
    axes = token_axes_of(io)
    if axes is None:  # no symbolic token axis: nothing in the graph can be told apart as per-token
        return []
    live = live_nodes(graph, io)
    done: list[str] = []
    failures: list[tuple[str, str]] = []
    b = Builder(graph, "/per_sequence")
    done += _replace_past_length_positions(io, live, axes, b)
    done += rope_choice.rewrite_rotary_embedding_choices(graph, io, live.order, b)
    if done:  # the packed positions may be new: they are per-token values the checks below must know
        axes, live = token_axes_of(io), live_nodes(graph, io)
    deferred: dict[ir.Node, str] = {}  # reductions the choice rewrite cannot take: the flow's segment ops may
    for node, why in _token_reductions(live, axes):
        if why is None:
            why = rewrite_choice(io, live, axes, b, node, done)
        if why is not None:
            deferred[node] = f"reduces across the tokens of every sequence in the step: {why}"
    failures += _token_counts(live, axes)
    if not failures:
        for node, why in flow_rewrites(graph, io, b, done):
            failures.append((describe(node), deferred.pop(node, why)))
        still = live_nodes(graph, io).nodes
        failures += [(describe(n), why) for n, why in deferred.items() if n in still]
    else:
        failures = [(describe(n), why) for n, why in deferred.items()] + failures
    if failures:
        raise ConversionError(
            "values computed over the whole packed step (every sequence's tokens) cannot be made per sequence; "
            "batched results would differ from each sequence run alone",
            failures,
        )
    return done


# -- token counts read with Shape ---------------------------------------------------------------------------------


Elements = frozenset[int] | None  # which elements of a shape vector hold the token count (None: all of them)


def _count_sources(live: Live, axes: TokenAxes) -> list[tuple[ir.Value, Elements]]:
    """Outputs of live ``Shape``/``Size`` nodes of the dense graph that read the token count, and where it is.

    Shapes of the paged inputs themselves are the rewriter's own packed-aware index arithmetic.
    """
    out: list[tuple[ir.Value, Elements]] = []
    for node in live.order:
        if node.inputs and node.inputs[0] in axes.known:
            continue
        if node.op_type == "Size" and axes.token_axes(node.inputs[0]):
            out.append((node.outputs[0], None))
        elif node.op_type == "Shape":
            token = axes.token_axes(node.inputs[0])
            if not token:
                continue
            rank = axes.rank(node.inputs[0])
            picked = list(range(rank))[slice(int_attr(node, "start", 0), int_attr(node, "end", rank))]
            where = frozenset(i for i, axis in enumerate(picked) if axis in token)
            if where:
                out.append((node.outputs[0], where))
    return out


def _token_counts(live: Live, axes: TokenAxes) -> list[tuple[str, str]]:
    """The packed token count used as a number (not as a size): the sequence alone would see its own count."""
    failures = []
    reported: set[ir.Node] = set()
    stack = _count_sources(live, axes)
    seen: set[tuple[ir.Value, Elements]] = set()
    while stack:
        value, where = stack.pop()
        if (value, where) in seen:
            continue
        seen.add((value, where))
        for node in live.consumers(value):
            slots = {i for i, x in enumerate(node.inputs) if x is value}
            if slots <= _SHAPE_ARGUMENTS.get(node.op_type, set()):
                continue
            if _token_enumeration(node, slots):
                continue
            if node.op_type in _COUNT_ARITHMETIC and _shape_like(node, slots, axes):
                picked = _elements_after(node, value, where, axes)
                if picked is None or picked:  # an empty set: the count is not among the elements passed on
                    stack.append((node.outputs[0], picked or None))
            elif node not in reported:
                reported.add(node)
                failures.append(
                    (
                        describe(node),
                        "uses the number of tokens in the step (read with Shape) as a value; alone, a sequence "
                        "would see its own token count",
                    )
                )
    return failures


def _token_enumeration(node: ir.Node, slots: set[int]) -> bool:
    """``Range(0, count, 1)``: an enumeration of the step's tokens (or of token x expert slots), which MoE routing
    uses to sort tokens by expert and back. It depends on the packing only through the order of the tokens, which
    the gathers / scatters that read it undo; each token is still routed by its own hidden state. (Positions
    never come from it in a model ortpa converts: they come from ``position_ids`` or ``past + Range``, rewritten
    above.)"""
    if node.op_type != "Range" or slots != {1}:
        return False
    start, delta = const_array(node.inputs[0]), const_array(node.inputs[2])
    return (
        start is not None
        and delta is not None
        and start.size == delta.size == 1
        and int(start) == 0
        and int(delta) == 1
    )


def _shape_like(node: ir.Node, slots: set[int], axes: TokenAxes) -> bool:
    """Integer arithmetic on shapes (``seq * heads``, a Concat of dims, a -1 test for Expand): a size, not a value.

    A comparison or a Where stays a size only on a vector of several dims; on one number it is a decision.
    """
    if node.op_type == "Gather" and 1 in slots:  # indexing with the count
        return False
    out = node.outputs[0]
    dims, dtype = axes.dims(out), axes.dtype(out)
    if dims is None or len(dims) > 1:
        return False
    if node.op_type in ("Equal", "Where"):
        return len(dims) == 1 and isinstance(dims[0], int) and dims[0] > 1
    return dtype in (ir.DataType.INT64, ir.DataType.INT32)


def _elements_after(node: ir.Node, value: ir.Value, where: Elements, axes: TokenAxes) -> Elements:
    """Which elements of ``node``'s output hold the count (a Gather or Slice of a shape vector may drop it)."""
    if where is None:
        return None
    if node.op_type == "Gather" and node.inputs[0] is value:
        idx = const_array(node.inputs[1])
        if idx is None:
            return None
        size = axes.dims(value)
        n = size[0] if size and isinstance(size[0], int) else None
        picks = [int(i) % n if n else int(i) for i in idx.reshape(-1)]
        hit = frozenset(j for j, i in enumerate(picks) if i in where)
        return None if hit and idx.ndim == 0 else hit
    if node.op_type == "Slice" and node.inputs[0] is value:
        bounds = [const_array(x) if x is not None else None for x in node.inputs[1:3]]
        if any(b is None or b.size != 1 for b in bounds) or len(node.inputs) > 4:
            return None
        start, end = (int(b.reshape(-1)[0]) for b in bounds)
        if start < 0 or end < 0:
            return None
        return frozenset(i - start for i in where if start <= i < end)
    if node.op_type == "Concat":
        offset = 0
        for x in node.inputs:
            if x is value:
                return frozenset(offset + i for i in where)
            dims = axes.dims(x)
            if not dims or not isinstance(dims[0], int):
                return None
            offset += dims[0]
    if node.op_type in ("Identity", "Cast", "Reshape") and node.inputs[0] is value:
        return where
    return None


# -- positions = past_len + Range(0, seq) ------------------------------------------------------------------------


def _dim_read(value: ir.Value | None, axes: TokenAxes) -> tuple[ir.Value, int] | None:
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


def _replace_past_length_positions(io: packed.PagedIO, live: Live, axes: TokenAxes, b: Builder) -> list[str]:
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
        pos = packed.positions(b, io)
        if out.dtype not in (None, ir.DataType.INT64):
            pos = b.op("Cast", [pos], {"to": out.dtype})
        out.replace_all_uses_with(pos)
        done.append(f"{describe(node)}: past length (Shape of a dense cache) + Range(seq) -> packed positions")
    return done
