"""Dataflow over the packed graph: for every value, whether it is per token, per step, or constant.

Seeds are the packed step's per-token values (:meth:`ortpa.rewriter.packed.PagedIO.seeds`: ``input_ids``, the
positions, and what the rewriter itself built per token) and the outputs of the ``PagedAttention`` nodes (the
op reads the sequence boundaries itself). From them a forward pass over the live nodes gives every value a
:class:`Kind` from each op's semantics and the ranks of its inputs, never from names:

* ``const``: no dependence on the step's tokens;
* ``count``: an integer computed from the step's token count (``Shape`` of a per-token value); checked by
  :func:`ortpa.rewriter.per_sequence.reductions._token_counts`, which allows it only as a size;
* ``token``: one axis (``axis``) is the packed token axis and each slice along it depends on its own token only;
* ``enum``: like ``token``, but the values hold each token's index in the packed step (``Range(0, count, 1)``, or
  rows ``0..count-1`` of a constant table): alone, a sequence would see its own indices ``0..len-1``. Used only
  to re-index the tokens themselves (``Gather`` on the token axis of a per-token value) it is exact; used as a
  value (learned absolute positions) :mod:`ortpa.rewriter.per_sequence` makes its sources per sequence;
* ``route``: rows regrouped across the step (``node``: the sort that regrouped them, ``role``: what the value is to
  it). MoE dispatch sorts every (token, expert) row of the step and puts the rows back:
  :mod:`ortpa.rewriter.per_sequence.routes` follows the sorted rows and shows them put back on their own tokens
  (the kind turns ``token`` again) or names the leak; a regrouping nothing undoes stays ``route`` and is refused
  where it reaches the logits or a cache (:mod:`ortpa.rewriter.per_sequence.segments`);
* ``step``: depends on more than one sequence of the step: ``why`` says how, ``node`` where. An op with no rule
  here and a non-constant input gives ``step``: unknown is step-wide. Where only a shape is missing (what
  :mod:`ortpa.rewriter.shape_recovery` could not recover) the value is ``step`` but not ``definite`` (the flow
  lost the token axis); reaching the logits or a cache, it is refused like any other step-wide value.

A token axis may be "blocked" (``block`` rows per token): a reshape folding each token's trailing elements into
rows of the token axis (``[1, T, 4 * 32] -> [1, T * 4, 32]``) and back. Kinds and state live in
:mod:`ortpa.rewriter.per_sequence.kinds`, the layout ops in :mod:`ortpa.rewriter.per_sequence.layout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import onnx_ir as ir

from ortpa.rewriter._graph import const_array, int_attr, ints_attr
from ortpa.rewriter.per_sequence import routes, selections
from ortpa.rewriter.per_sequence.kinds import CONST, COUNT, Flow, Kind, unknown_op
from ortpa.rewriter.per_sequence.kinds import lost as _lost
from ortpa.rewriter.per_sequence.kinds import norm as _norm
from ortpa.rewriter.per_sequence.kinds import step as _step
from ortpa.rewriter.per_sequence.layout import gather_nd as _gather_nd
from ortpa.rewriter.per_sequence.layout import keep as _keep
from ortpa.rewriter.per_sequence.layout import reshape as _reshape
from ortpa.rewriter.per_sequence.layout import squeeze_like as _squeeze_like
from ortpa.rewriter.per_sequence.layout import transpose as _transpose

__all__ = ["Flow", "Kind", "analyse"]

# Element by element, with numpy broadcasting (inputs right-aligned).
_ELEMENTWISE = frozenset(
    "Abs Acos Add And Asin Atan Ceil Clip Cos Cosh Div Equal Erf Exp Floor Greater GreaterOrEqual HardSigmoid "
    "Identity IsInf IsNaN LeakyRelu Less LessOrEqual Log Max Mean Min Mod Mul Neg Not Or Pow PRelu Reciprocal "
    "Relu Round Selu Sigmoid Sign Sin Sinh Softplus Softsign Sqrt Sub Sum Tan Tanh Where Xor Cast CastLike Elu "
    "Celu Gelu Mish HardSwish BitShift BitwiseAnd BitwiseOr BitwiseXor BitwiseNot ThresholdedRelu "
    "FastGelu QuickGelu BiasGelu".split()
)
# Normalise (or soft-max) over the trailing axes from ``axis``: per token unless they include the token axis.
_LAST_AXES = {
    "Softmax": -1,
    "LogSoftmax": -1,
    "LayerNormalization": -1,
    "SimplifiedLayerNormalization": -1,
    "SkipLayerNormalization": -1,
    "SkipSimplifiedLayerNormalization": -1,
    "RMSNormalization": -1,
}
_REDUCTIONS = frozenset(
    "ReduceMax ReduceMin ReduceSum ReduceMean ReduceProd ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp "
    "ReduceSumSquare ArgMax ArgMin".split()
)


def analyse(
    order: list[ir.Node],
    seeds: dict[ir.Value, Kind],
    trusted: set[ir.Node],
    batch: frozenset[str] = frozenset(),
    dense: frozenset = frozenset(),
    composites: Sequence = (),
) -> Flow:
    """Kinds of every value computed by ``order`` (topological). ``trusted`` nodes (the rewriter's own index
    arithmetic behind the seeds) are not analysed; ``batch``: the dense batch dim's symbols; ``dense``: the
    dense graph's own nodes. ``composites`` (:class:`ortpa.rewriter.mla_expanded.Composite`): groups of the
    rewriter's nodes that act as one attention op; each has PagedAttention's rule, from its data inputs to its
    output (the group's inner row split and merge are the op's own, as the sequence boundaries are the op's)."""
    flow = Flow(dict(seeds), batch, dense)
    outputs = {c.output.producer(): c for c in composites}
    inner = set().union(*(c.nodes for c in composites)) - set(outputs)
    for node in order:
        if node in outputs:
            c = outputs[node]
            ins = [flow.of(x) for x in c.inputs]
            steps = sorted((k for k in ins if k.tag == "step"), key=lambda k: not k.definite)
            flow.kinds[c.output] = steps[0] if steps else _attention_rule(node, ins, flow, (c.rank, c.axis))[0]
            continue
        if node in trusted or node in inner:
            continue
        outs = _transfer(node, flow)
        for value, kind in zip(node.outputs, outs, strict=False):
            if value not in seeds:
                if kind.rank is None and value.shape is not None and kind.tag != "step":
                    kind = Kind(kind.tag, len(value.shape), kind.axis, kind.sources, kind.why, kind.node)
                flow.kinds[value] = kind
    return flow


def _transfer(node: ir.Node, flow: Flow) -> list[Kind]:
    ins = [flow.of(x) for x in node.inputs]
    n_out = len(node.outputs)
    op = node.op_type
    if op == "Shape" and _fixed_shape(node.inputs[0], flow):  # dims only, the same in every step
        return [CONST]
    steps = sorted((k for k in ins if k.tag == "step"), key=lambda k: not k.definite)
    if steps:  # the first definite cause is what a refusal names
        return [steps[0]] * n_out
    if node.domain == "com.microsoft" and op == "PagedAttention":
        return _attention_rule(node, ins[:1], flow) + [CONST] * (n_out - 1)
    data_tags = {k.tag for k in ins} - {"const", "count"}
    if op == "Range" and not data_tags and ins[1].tag == "count":
        return _range(node, ins, flow)
    if op in ("Slice", "Gather") and not data_tags and ins[0].tag == "const" and any(k.tag == "count" for k in ins[1:]):
        return [_table_rows(node, ins, flow)]
    if not data_tags:
        if op in ("Shape", "Size") or any(k.tag == "count" for k in ins):
            return [COUNT] * n_out
        return [CONST] * n_out
    if "route" in data_tags:
        return routes.transfer(node, ins, flow, lambda n, k: _token_transfer(n, k, flow))
    return _token_transfer(node, ins, flow)


def _fixed_shape(value: ir.Value, flow: Flow) -> bool:
    """Every dim static (transformers 4.x's ``index_add`` reads the shape of ``out[0:1]``, a slice of the tokens)."""
    dims = flow.dims(value)
    return dims is not None and all(isinstance(d, int) for d in dims)


def _token_transfer(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    """The rules for per-token (and enumeration) inputs, by op."""
    n_out = len(node.outputs)
    op = node.op_type
    if op in ("Shape", "Size"):
        return [_shape_kind(node, ins[0], flow)]
    handler = _HANDLERS.get(op)
    if handler is not None and node.domain in ("", "ai.onnx", "com.microsoft"):
        return handler(node, ins, flow)
    if op in _ELEMENTWISE:
        return [_broadcast(node, ins, flow)] * n_out
    if op in _LAST_AXES:
        return _last_axes(node, ins, flow)
    if op in _REDUCTIONS:
        return [_reduction(node, ins, flow)] * n_out
    return [unknown_op(node, f"{node.domain or 'ai.onnx'}::{op} has no per-token rule here")] * n_out


def _attention_rule(node: ir.Node, ins: list[Kind], flow: Flow, declared: tuple[int, int] | None = None) -> list[Kind]:
    """An attention op reading the sequence boundaries itself: each output row is its token's own (step-wide
    inputs were handled before); regrouped input rows are not followed. ``declared``: (rank, token axis) of a
    composite's output; a PagedAttention output is ``[tokens, width]``."""
    routed = [k for k in ins if k.tag == "route"]
    if routed:  # other tokens' rows (or the sort's positions / counts) in a token's place
        return [_step(node, f"its query's rows are regrouped{_by(routed[0])} and not put back in token order")]
    rank, axis = declared if declared is not None else (flow.rank(node.outputs[0]) or 2, None)
    q = ins[0] if ins else CONST
    if axis is None:
        axis = q.axis if q.tag == "token" else 0
    enum = [k for k in ins if k.tag == "enum"]
    if enum:
        return [Kind("enum", rank, axis, frozenset().union(*(k.sources for k in enum)))]
    return [Kind("token", rank, axis)]


def _table_rows(node: ir.Node, ins: list[Kind], flow: Flow) -> Kind:
    """``table[0:count]`` of a constant: its rows 0..count-1, one per packed token (an ``enum``)."""
    rank = flow.rank(node.inputs[0])
    if node.op_type == "Slice" and rank is not None:
        starts = const_array(node.inputs[1])
        axes_arr = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        steps = const_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
        axes = [_norm(int(a), rank) for a in axes_arr.reshape(-1)] if axes_arr is not None else [0]
        if starts is not None and len(axes) == 1 and int(starts.reshape(-1)[0]) == 0:
            if steps is None or int(steps.reshape(-1)[0]) == 1:
                return Kind("enum", rank, axes[0], frozenset({node}))
    return _step(node, "it reads a constant at the step's token count")


def _shape_kind(node: ir.Node, kind: Kind, flow: Flow) -> Kind:
    if kind.tag not in ("token", "enum") or node.op_type == "Size":
        return COUNT
    rank = kind.rank
    if rank is None:
        return COUNT
    picked = list(range(rank))[slice(int_attr(node, "start", 0), int_attr(node, "end", rank))]
    return COUNT if kind.axis in picked else CONST


def _aligned(kind: Kind, out_rank: int | None) -> int | None:
    if kind.rank is None or out_rank is None or kind.axis is None:
        return None
    return kind.axis + (out_rank - kind.rank)


def _broadcast(node: ir.Node, ins: list[Kind], flow: Flow) -> Kind:
    ranks = [flow.rank(x) if k.tag in ("const", "count") else k.rank for x, k in zip(node.inputs, ins, strict=True)]
    if any(r is None for r, k in zip(ranks, ins, strict=True) if k.tag in ("token", "enum")):
        return _lost(node, "an input's rank is unknown, so its token axis cannot be followed")
    out_rank = max((r for r in ranks if r is not None), default=None)
    if node.op_type in ("Cast", "CastLike", "Identity") or len(node.inputs) == 1:
        out_rank = ins[0].rank
    elif None in ranks:  # an operand of unknown rank (built by the rewriter): the output's declared rank decides
        stored = node.outputs[0].shape
        if stored is None:
            return _lost(node, "an operand's rank is unknown, so the token axis of the result cannot be followed")
        out_rank = len(stored)
    axes = {_aligned(k, out_rank) for k in ins if k.tag in ("token", "enum")}
    if len(axes) != 1:
        return _step(node, "it combines token axes of different positions (every token with every other)")
    (axis,) = axes
    blocks = {k.block for k in ins if k.tag in ("token", "enum")}
    if len(blocks) != 1:
        return _step(node, "it combines token axes holding different numbers of rows per token")
    enum = [k for k in ins if k.tag == "enum"]
    if enum:
        return Kind("enum", out_rank, axis, frozenset().union(*(k.sources for k in enum)), block=blocks.pop())
    return Kind("token", out_rank, axis, block=blocks.pop())


def _last_axes(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    k = ins[0]
    if k.tag not in ("token", "enum") or k.rank is None:
        return [_lost(node, "its input is not per token along a known axis")] * len(node.outputs)
    axis = _norm(int_attr(node, "axis", _LAST_AXES[node.op_type]), k.rank)
    covered = range(axis, k.rank) if node.op_type not in ("Softmax", "LogSoftmax") else [axis]
    if k.axis in covered:
        return [_step(node, "it normalises across the token axis")] * len(node.outputs)
    others = [x for x in ins[1:] if x.tag in ("token", "enum")]  # Skip*Normalization: the skip input
    if others and any(_aligned(x, k.rank) != k.axis for x in others):
        return [_step(node, "its inputs have different token axes")] * len(node.outputs)
    return [replace(k, rank=k.rank, axis=k.axis)] * len(node.outputs)


def _reduction(node: ir.Node, ins: list[Kind], flow: Flow) -> Kind:
    k = ins[0]
    if k.tag not in ("token", "enum") or k.rank is None:
        return _lost(node, "it reduces a value whose token axis is unknown")
    if node.op_type in ("ArgMax", "ArgMin"):
        axes = [_norm(int_attr(node, "axis", 0), k.rank)]
        keep = int_attr(node, "keepdims", 1)
    else:
        arr = const_array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
        axes = [int(a) for a in arr.reshape(-1)] if arr is not None else (ints_attr(node, "axes") or [])
        if len(node.inputs) > 1 and node.inputs[1] is not None and arr is None:
            return _lost(node, "its axes are computed at run time")
        if not axes:
            axes = [] if int_attr(node, "noop_with_empty_axes", 0) else list(range(k.rank))
        axes = [_norm(a, k.rank) for a in axes]
        keep = int_attr(node, "keepdims", 1)
    if k.axis in axes:
        return _step(node, f"{node.op_type} reduces across the token axis")
    if keep:
        return replace(k, rank=k.rank, axis=k.axis)
    return replace(k, rank=k.rank - len(set(axes)), axis=k.axis - sum(a < k.axis for a in set(axes)))


# -- layout ops -------------------------------------------------------------------------------------------------


def _gather(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    data, idx = ins[0], ins[1]
    axis = _norm(int_attr(node, "axis", 0), data.rank if data.rank is not None else flow.rank(node.inputs[0]))
    idx_rank = idx.rank if idx.tag != "const" else flow.rank(node.inputs[1])
    if idx.tag == "const":  # constant indices: along the token axis only to select one token (x[:, -1])
        if data.tag in ("token", "enum") and axis == data.axis:
            return [_step(node, "it picks fixed tokens of the packed step (e.g. the last)")]
        if data.rank is None or idx_rank is None:
            return [_lost(node, "ranks unknown")]
        out_axis = data.axis if data.axis < axis else data.axis - 1 + idx_rank
        return [replace(data, rank=data.rank - 1 + idx_rank, axis=out_axis)]
    if idx.tag in ("token", "enum") and data.tag in ("token", "enum") and axis == data.axis:
        # re-indexing the tokens by their own packed index (Range(0, count, 1) itself): the identity, exact
        if idx.tag == "enum" and idx.rank == 1 and _is_enumeration(node.inputs[1], idx):
            return [replace(data, rank=data.rank, axis=data.axis)]
        return [Kind("route", None, node=node)]
    if idx.tag in ("token", "enum") and data.tag == "const":  # a table lookup per token (embeddings)
        rank = (flow.rank(node.inputs[0]) or 1) - 1 + (idx.rank or 0)
        return [replace(idx, rank=rank, axis=axis + idx.axis)]
    if idx.tag == "count" and data.tag in ("token", "enum"):
        return [_step(node, "it indexes the token axis with the token count")]
    if idx.tag == "count":
        return [CONST if data.tag == "const" else _step(node, "indexes with the token count")]
    return [_step(node, "it gathers across tokens")]


def _is_enumeration(value: ir.Value, kind: Kind) -> bool:
    """``value`` is the output of one of ``kind``'s ``Range(0, count, 1)`` sources, through layout ops only (not
    ``count - 1 - t`` or ``t + 1``, which pick other tokens)."""
    while (node := value.producer()) is not None and node.op_type in ("Cast", "Identity", "Reshape", "Squeeze"):
        value = node.inputs[0]
    return value.producer() in kind.sources and value.producer().op_type == "Range"


def _range(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    start, limit, delta = ins
    if start.tag == "const" and delta.tag == "const" and limit.tag == "count":
        s, d = const_array(node.inputs[0]), const_array(node.inputs[2])
        if s is not None and d is not None and int(s) == 0 and int(d) == 1:
            return [Kind("enum", 1, 0, frozenset({node}))]
    return [Kind("route", 1, node=node)]


def _matmul(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    a, b = ins[0], ins[1]
    if a.tag in ("const", "count") and b.tag in ("token", "enum") and b.rank is not None and b.axis == b.rank - 1:
        a_rank = flow.rank(node.inputs[0]) or 2
        out_rank = max(a_rank, b.rank)
        return [replace(b, rank=out_rank, axis=out_rank - 1)]
    if b.tag not in ("const", "count"):
        return [_batched_matmul(node, a, b)]
    if a.tag not in ("token", "enum") or a.rank is None:
        return [_lost(node, "its operand's token axis is unknown")]
    if a.axis == a.rank - 1:
        return [_step(node, "it contracts the token axis")]
    b_rank = flow.rank(node.inputs[1]) or 2
    out_rank = max(a.rank, b_rank)
    return [replace(a, rank=out_rank, axis=a.axis + (out_rank - a.rank))]


def _batched_matmul(node: ir.Node, a: Kind, b: Kind) -> Kind:
    """Both operands per token: per token when the token axis is one of the batch axes of both, aligned (MoE
    batched_mm: each row times its own expert's matrix); else a contraction across tokens."""
    if a.tag != "token" or b.tag != "token" or a.rank is None or b.rank is None or a.block != b.block:
        return _step(node, "both of its operands depend on the tokens (a contraction across them)")
    out_rank = max(a.rank, b.rank)
    if a.axis >= a.rank - 2 or b.axis >= b.rank - 2 or _aligned(a, out_rank) != _aligned(b, out_rank):
        return _step(node, "both of its operands depend on the tokens (a contraction across them)")
    return replace(a, rank=out_rank, axis=_aligned(a, out_rank))


def _per_token_op(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    """Contrib ops that act on each token's row (MatMulNBits, RotaryEmbedding, MoE)."""
    k = ins[0]
    if k.tag not in ("token", "enum") or k.rank is None:
        return [_lost(node, "its input is not per token")] * len(node.outputs)
    if any(x.tag in ("token", "enum") and x.rank is not None and _aligned(x, k.rank) != k.axis for x in ins[1:]):
        if node.op_type != "RotaryEmbedding":
            return [_step(node, "its inputs have different token axes")] * len(node.outputs)
    if k.axis == k.rank - 1:
        return [_step(node, "it acts along the token axis")] * len(node.outputs)
    out = replace(k, rank=flow.rank(node.outputs[0]) or k.rank, axis=k.axis)
    return [out] * len(node.outputs)


def _cumsum(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    k = ins[0]
    if k.tag not in ("token", "enum") or k.rank is None or ins[1].tag != "const":
        return [_lost(node, "its input or axis is not known per token")]
    axis = const_array(node.inputs[1])
    if axis is None or _norm(int(axis.reshape(-1)[0]), k.rank) == k.axis:
        return [_step(node, "CumSum runs along the token axis")]
    return [replace(k, rank=k.rank, axis=k.axis)]


def _topk(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    k = ins[0]
    if k.tag not in ("token", "enum") or k.rank is None or ins[1].tag not in ("const", "count"):
        return [_lost(node, "its input or k is not known per token")] * len(node.outputs)
    if _norm(int_attr(node, "axis", -1), k.rank) == k.axis:
        if ins[1].tag == "count":  # a sort of the rows of the whole step (MoE dispatch) when k keeps them all
            return routes.sort_kinds(node, k, routes.is_own_length(node.inputs[1], node.inputs[0], k.axis))
        return [_step(node, "TopK picks tokens across the step")] * len(node.outputs)
    if ins[1].tag != "const":
        return [_lost(node, "its k depends on the token count")] * len(node.outputs)
    return [replace(k, sources=k.sources)] * len(node.outputs)


def _by(k: Kind) -> str:
    return f" by {k.node.op_type} node {k.node.name!r}" if k.node is not None else ""


def _scatter_elements(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    """``ScatterElements`` along a non-token axis of per-token (or token-count-sized) data: each token's row is
    written from its own row of indices / updates (MoE's group masks)."""
    tokens = [k for k in ins if k.tag in ("token", "enum")]
    if any(k.rank is None for k in tokens) or len({(k.rank, k.axis, k.block) for k in tokens}) != 1:
        return [_lost(node, "its inputs' token axes differ or are unknown")]
    k = tokens[0]
    if _norm(int_attr(node, "axis", 0), k.rank) == k.axis:
        return [_step(node, "it scatters along the token axis")]
    return [replace(k, tag="token", sources=frozenset())]


def _one_hot(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    """``OneHot(indices, depth, values)``: each index's own one-hot row, on a new axis at ``axis``."""
    k = ins[0]
    if k.tag != "token" or k.rank is None or any(x.tag != "const" for x in ins[1:]):
        return [_lost(node, "its indices are not per token along a known axis, or depth / values vary")]
    axis = _norm(int_attr(node, "axis", -1), k.rank + 1)
    return [replace(k, rank=k.rank + 1, axis=k.axis + (axis <= k.axis))]


_HANDLERS = {
    "ScatterElements": _scatter_elements,
    "GatherElements": _scatter_elements,
    "TopK": _topk,
    "CumSum": _cumsum,
    "Reshape": _reshape,
    "Squeeze": _squeeze_like,
    "Unsqueeze": _squeeze_like,
    "Transpose": _transpose,
    "Concat": _keep,
    "Split": _keep,
    "Slice": _keep,
    "Expand": _keep,
    "Tile": _keep,
    "Gather": _gather,
    "GatherND": _gather_nd,
    "Range": _range,
    "MatMul": _matmul,
    "Gemm": _matmul,
    "MatMulNBits": _per_token_op,
    "RotaryEmbedding": _per_token_op,
    "MoE": _per_token_op,
    "QMoE": _per_token_op,
    "OneHot": _one_hot,
    "NonZero": selections.nonzero,
}
