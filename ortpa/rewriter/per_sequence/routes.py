"""MoE dispatch in the per-sequence dataflow: rows regrouped by a sort of the whole step, and the proof that they
are put back, each on its own token.

Sort-based dispatch (transformers 5's ``grouped_mm`` lowering) flattens each token's ``k`` chosen experts to one
row per (token, expert), sorts the rows by expert over the whole step, runs each expert on its contiguous
segment of the sorted rows, and puts the rows back in token order. The sort itself depends on every token of the
step, but no row's *value* does, provided that

1. the sort keeps every row (``TopK`` over the whole axis, ``k`` its own length): its indices ``P`` are a
   permutation, ``P[j]`` the packed position of sorted row ``j``;
2. each sorted row is read from its own token: ``Gather(x, f(P))`` where ``f(P[j])`` is a row of the token that
   packed position ``P[j]`` belongs to. ``f`` (``P // k`` as the exporter writes floor division) is evaluated on
   the positions themselves, never matched by form;
3. everything between acts row by row: elementwise with other sorted rows, a contraction along another axis, and
   expert segments ``Gather(rows, Range(a, b))`` that tile the sorted rows again when concatenated (the first
   starts at 0, each starts where the one before ends). A segment's bounds are counted over the whole step
   (``meta``): they decide only which expert computes a row, never its value's inputs;
4. the rows go back to token order through the inverse permutation (``ScatterND(zeros, P, Range(0, n))``
   then a gather by it) or by a scatter onto each row's own token (``index_add``).

Each kind of :class:`~ortpa.rewriter.per_sequence.kinds.Kind` with tag ``route`` carries its sort node (``node``)
and its ``role`` towards it: ``rows`` (values in sorted order, each from one token), ``perm`` (computed from ``P``
alone), ``meta`` (computed over every sorted row), ``seg`` / ``segrows`` (a segment's indices / rows, with
``bounds``), ``inverse`` (``P``'s inverse, in token order). Role ``""`` is a regrouping nothing undoes. Anything
else is a definite leak the refusal names: rows truncated or segments that skip or repeat rows (tokens competing
for an expert's capacity), sorted rows combined with rows in token order or with step-wide counts, positions
used as values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import const_array, int_attr
from ortpa.rewriter.per_sequence import selections
from ortpa.rewriter.per_sequence.arith import elementwise
from ortpa.rewriter.per_sequence.kinds import CONST, COUNT, Flow, Kind, norm, step

__all__ = ["is_own_length", "sort_kinds", "transfer"]

TokenRule = Callable[[ir.Node, list[Kind]], list[Kind]]

_ROW_ROLES = frozenset({"rows", "perm", "segrows", "inverse"})
_REDUCE = frozenset({"ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean"})
# Ops whose output is a function of their inputs' values only (no axis semantics): a step-wide count stays one.
_LAYOUT = frozenset({"Reshape", "Squeeze", "Unsqueeze", "Identity", "Cast", "Flatten", "Transpose", "Expand"})
# f(P) is evaluated on the positions of the first _SAMPLE_ROWS tokens and of _SAMPLE_ROWS tokens ending at
# _FAR_TOKEN (past any step's token count): what exporters write (k's floor division with its sign correction) is
# the same on both, a clamp or an offset is not
_SAMPLE_ROWS = 4096
_FAR_TOKEN = 2**24


def sort_kinds(node: ir.Node, data: Kind, k_is_full: bool) -> list[Kind]:
    """A ``TopK`` along the token axis: a sort of every row (values ``rows``, indices ``perm``) when ``k`` is the
    axis's own length, else a pick of some rows of the whole step."""
    if not k_is_full:
        return [step(node, "TopK keeps some rows of the whole step (k is not the length of the axis it sorts)")] * 2
    common = {"rank": data.rank, "axis": data.axis, "node": node, "span": data.block}
    return [Kind("route", role="rows", **common), Kind("route", role="perm", **common)]


def is_own_length(k: ir.Value, data: ir.Value, axis: int) -> bool:
    """``k`` is dim ``axis`` of ``data`` itself, read with ``Shape`` (through Gather / shape-only ops)."""
    picked: int | None = None
    while (node := k.producer()) is not None:
        if node.op_type in ("Reshape", "Squeeze", "Unsqueeze", "Cast", "Identity"):
            k = node.inputs[0]
        elif node.op_type == "Gather" and picked is None:
            idx = const_array(node.inputs[1])
            if idx is None or idx.size != 1:
                return False
            picked, k = int(idx.reshape(-1)[0]), node.inputs[0]
        elif node.op_type == "Shape":
            rank = len(data.shape) if data.shape is not None else None
            if node.inputs[0] is not data or rank is None:
                return False
            dims = list(range(rank))[slice(int_attr(node, "start", 0), int_attr(node, "end", rank))]
            if picked is None:
                return dims == [axis]
            return -len(dims) <= picked < len(dims) and dims[picked] == axis
        else:
            return False
    return False


def transfer(node: ir.Node, ins: list[Kind], flow: Flow, token_rule: TokenRule) -> list[Kind]:
    """The kinds of ``node``'s outputs when an input is a ``route`` (see the module docstring)."""
    n_out = len(node.outputs)
    routes = [k for k in ins if k.tag == "route"]
    origin = routes[0].node
    if any(k.node is not origin for k in routes):
        return [step(node, "it combines rows regrouped by different sorts")] * n_out
    if any(k.role == "" for k in routes):  # a regrouping nothing undoes stays one until a sink refuses it
        return [Kind("route", flow.rank(node.outputs[0]), node=origin)] * n_out
    where = _where(origin)
    op = node.op_type
    special = _SPECIAL.get(op)
    if any(k.role == selections.COORDS for k in routes):  # NonZero's selection, not a sort
        special = selections.SPECIAL.get(op)
    if special is not None and node.domain in ("", "ai.onnx"):
        out = special(node, ins, flow)
        if out is not None:
            return out
    roles = {k.role for k in routes}
    if any(k.tag in ("token", "enum") for k in ins):
        return [step(node, f"it combines rows regrouped {where} with rows in token order")] * n_out
    if roles == {"meta"}:
        return [replace(routes[0], rank=flow.rank(node.outputs[0]))] * n_out
    if "meta" in roles:
        return [step(node, f"it combines regrouped rows with values counted over every row {where}")] * n_out
    if op == "Shape":
        return _shape(node, routes[0])
    if len(roles) > 1 or len({k.bounds for k in routes}) > 1:
        return [step(node, f"it combines rows {where} with their positions or with other segments")] * n_out
    (role,) = roles
    if role in ("seg", "inverse"):
        if op not in _LAYOUT:
            return [step(node, f"it computes with the positions of rows regrouped {where}")] * n_out
    as_tokens = [Kind("token", k.rank, k.axis) if k.tag == "route" else k for k in ins]
    outs = token_rule(node, as_tokens)
    if role == "rows" and op in _REDUCE and outs[0].tag == "step":  # counted over every sorted row
        return [Kind("route", flow.rank(node.outputs[0]), node=origin, role="meta", span=routes[0].span)] * n_out
    if op == "Reshape" and not (outs[0].tag == "token" and outs[0].block == 1):
        # the sorted axis split or merged: rows of different tokens side by side, as if they were in token order
        return [step(node, f"it folds rows regrouped {where} together (rows of different tokens in one group)")]
    result = []
    for out in outs:
        if out.tag == "token":
            out = Kind(
                "route", out.rank, out.axis, node=origin, role=role, span=routes[0].span, bounds=routes[0].bounds
            )
        elif out.tag == "step":
            out = replace(out, why=f"{out.why} (its rows regrouped {where})")
        result.append(out)
    return result


def _where(origin: ir.Node | None) -> str:
    return f"by the sort {origin.name!r}" if origin is not None else "across the step"


def _shape(node: ir.Node, k: Kind) -> list[Kind]:
    if k.role in ("seg", "segrows"):  # a segment's length is counted over the whole step
        return [Kind("route", 1, node=k.node, role="meta", span=k.span)]
    if k.rank is None:
        return [COUNT]
    picked = list(range(k.rank))[slice(int_attr(node, "start", 0), int_attr(node, "end", k.rank))]
    return [COUNT if k.axis in picked else CONST]


# -- gathers, scatters, segments ----------------------------------------------------------------------------------


def _gather(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind] | None:
    """``Gather`` / ``GatherND`` (one index per row) along the rows: a sort's rows read from their tokens, an expert
    segment, or the sorted rows put back in token order."""
    data, idx = ins[0], ins[1]
    if node.op_type == "GatherND":
        if int_attr(node, "batch_dims", 0) != 0 or flow.rank(node.inputs[1]) is None:
            return None
        idx_rank = flow.rank(node.inputs[1])
        dims = flow.dims(node.inputs[1])
        if not dims or dims[-1] != 1:  # one leading data axis per index row
            return None
        axis, out_lead = 0, idx_rank - 1
    else:
        data_rank = data.rank if data.rank is not None else flow.rank(node.inputs[0])
        axis = norm(int_attr(node, "axis", 0), data_rank)
        idx_rank = idx.rank if idx.rank is not None else flow.rank(node.inputs[1])
        out_lead = idx_rank
    if idx.tag != "route" or idx_rank is None or data.rank is None:
        return None
    if out_lead != 1 or (idx.axis or 0) != 0:
        return None
    if data.tag == "route" and data.axis != axis:
        return None  # a gather along another axis of sorted rows: the row-wise rules
    if data.tag in ("token", "enum") and data.axis != axis:
        return [step(node, f"it gathers a per-token value by the positions of rows regrouped {_where(idx.node)}")]
    out_axis, out_rank = axis, data.rank - 1 + out_lead
    if data.tag == "token" and idx.role == "perm":
        if _reads_own_token(node.inputs[1], idx, data.block):
            return [Kind("route", out_rank, out_axis, node=idx.node, role="rows", span=idx.span)]
        return [step(node, f"it reads rows of other tokens than those the sort {idx.node.name!r} moved")]
    if data.tag == "route" and data.role == "rows" and idx.role == "seg":
        return [Kind("route", out_rank, out_axis, node=idx.node, role="segrows", span=idx.span, bounds=idx.bounds)]
    if data.tag == "route" and data.role == "rows" and idx.role == "inverse":
        return [Kind("token", out_rank, out_axis, block=idx.span)]
    return [step(node, f"it gathers rows regrouped {_where(idx.node)} by other indices than their inverse")]


def _scatter(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind] | None:
    """``ScatterND(zeros, P, Range(0, n))``: the inverse permutation; ``ScatterND(x, f(P), rows)``: each sorted row
    written (or added) back onto its own token."""
    data, idx, upd = ins[0], ins[1], ins[2]
    reduction = node.attributes.get("reduction")
    if (
        reduction is not None
        and reduction.value == "add"
        and data.tag in ("const", "count")
        and upd.tag in ("const", "count")
        and idx.tag == "route"
        and idx.role == "rows"
        and idx.rank == 1
    ):
        # constants added at the sorted rows' values: a histogram (rows per expert, transformers 5's histc as
        # OnnxExporter writes it), counted over every row like a segment's bounds
        return [Kind("route", 1, node=idx.node, role="meta", span=idx.span)]
    if node.op_type == "ScatterND":
        dims = flow.dims(node.inputs[1])
        if not dims or dims[-1] != 1 or idx.tag != "route" or idx.role != "perm":
            return None
    elif node.op_type != "ScatterElements" or idx.tag != "route" or idx.role != "perm" or idx.rank != 1:
        return None
    if data.tag in ("const", "count") and upd.tag == "enum" and upd.rank == 1 and _is_range(node.inputs[2], upd):
        if _is_perm_itself(node.inputs[1], idx):
            return [Kind("route", 1, 0, node=idx.node, role="inverse", span=idx.span)]
        return [step(node, f"it builds an index from the sort {idx.node.name!r} that is not its inverse")]
    if data.tag == "token" and data.axis == 0 and upd.tag == "route" and upd.role == "rows" and upd.axis == 0:
        if _reads_own_token(node.inputs[1], idx, data.block):
            return [replace(data)]
        return [step(node, f"it writes rows regrouped {_where(idx.node)} onto other tokens than their own")]
    return None


def _range(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind] | None:
    """``Range(a, b, 1)`` between bounds counted over the sorted rows: the indices of one expert's segment."""
    start, limit, _delta = ins
    d = const_array(node.inputs[2])
    if limit.tag != "route" or limit.role != "meta" or d is None or d.size != 1 or int(d.reshape(-1)[0]) != 1:
        return None
    if start.tag == "const":
        s = const_array(node.inputs[0])
        if s is None or s.size != 1 or int(s.reshape(-1)[0]) != 0:
            return None
        lo: ir.Value | None = None
    elif start.tag == "route" and start.role == "meta":
        lo = _root(node.inputs[0])
    else:
        return None
    bounds = (lo, _root(node.inputs[1]))
    return [Kind("route", 1, 0, node=limit.node, role="seg", span=limit.span, bounds=bounds)]


def _concat(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind] | None:
    """Expert segments concatenated along the rows: the sorted rows again when the segments tile them."""
    segs = [k for k in ins if k.tag == "route" and k.role == "segrows"]
    if not segs:
        return None
    axis = norm(int_attr(node, "axis", 0), segs[0].rank)
    if axis != segs[0].axis:
        return None
    if len(segs) != len(ins) or any(k.axis != axis for k in segs):
        return [step(node, f"it concatenates expert segments with other rows {_where(segs[0].node)}")]
    lo = None
    for k in segs:
        if k.bounds[0] is not lo:
            return [
                step(
                    node,
                    f"its expert segments do not tile the rows sorted {_where(k.node)} (rows skipped or repeated: "
                    "tokens compete for places across the step)",
                )
            ]
        lo = k.bounds[1]
    first = segs[0]
    return [Kind("route", first.rank, axis, node=first.node, role="rows", span=first.span)]


_SPECIAL: dict[str, Callable[[ir.Node, list[Kind], Flow], list[Kind] | None]] = {
    "Gather": _gather,
    "GatherND": _gather,
    "ScatterND": _scatter,
    "ScatterElements": _scatter,
    "Range": _range,
    "Concat": _concat,
}


def _root(value: ir.Value) -> ir.Value:
    """The value behind shape-only ops (a segment bound squeezed or cast on its way to ``Range``)."""
    while (node := value.producer()) is not None and node.op_type in ("Squeeze", "Unsqueeze", "Cast", "Identity"):
        if node.op_type == "Cast" and node.inputs[0].dtype not in (None, value.dtype):
            if not (_is_int(node.inputs[0].dtype) and _is_int(value.dtype)):
                break
        value = node.inputs[0]
    return value


def _is_int(dtype: ir.DataType | None) -> bool:
    return dtype in (ir.DataType.INT64, ir.DataType.INT32)


def _is_range(value: ir.Value, kind: Kind) -> bool:
    """``value`` is ``Range(0, count, 1)`` itself (through shape-only ops), one of ``kind``'s sources."""
    value = _root(value)
    node = value.producer()
    return node is not None and node in kind.sources and node.op_type == "Range"


# -- f(P), evaluated ---------------------------------------------------------------------------------------------


def _reads_own_token(index: ir.Value, idx: Kind, block: int) -> bool:
    """``index`` = f(P) reads, for each sorted row, a row of the token its position belongs to (``block`` rows per
    token in the data, ``idx.span`` per token in the sorted axis)."""
    v = _positions(idx.span)
    f = _index_map(index, idx, v)
    return f is not None and np.array_equal(f // block, v // idx.span)


def _is_perm_itself(index: ir.Value, idx: Kind) -> bool:
    v = _positions(idx.span)
    f = _index_map(index, idx, v)
    return f is not None and np.array_equal(f, v)


def _positions(span: int) -> np.ndarray:
    span = max(span, 1)
    near = np.arange(_SAMPLE_ROWS * span, dtype=np.int64)
    return np.concatenate([near, near + (_FAR_TOKEN - _SAMPLE_ROWS) * span])


def _index_map(index: ir.Value, idx: Kind, v: np.ndarray) -> np.ndarray | None:
    """f(P) at the sorted positions ``v``, or None where f is not computed from ``P`` and scalar constants alone (or
    gives non-integers)."""
    f = _evaluate(index, idx.node.outputs[1], v)
    if f is None or f.shape != v.shape or not np.issubdtype(f.dtype, np.integer):
        return None
    return f.astype(np.int64)


def _evaluate(value: ir.Value, perm: ir.Value, v: np.ndarray, depth: int = 0) -> np.ndarray | None:
    """``value`` as a function of the sort's indices ``perm`` (given as ``v``), element by element, where it is
    computed from them and scalar constants only; None otherwise."""
    if value is perm:
        return v
    arr = const_array(value)
    if arr is not None:
        return arr.reshape(()) if arr.size == 1 else None
    node = value.producer()
    if node is None or depth > 24 or node.domain not in ("", "ai.onnx"):
        return None
    op = node.op_type
    if op in ("Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten"):
        return _evaluate(node.inputs[0], perm, v, depth + 1)
    args = [_evaluate(x, perm, v, depth + 1) if x is not None else None for x in node.inputs[:3]]
    return elementwise(node, args)
