"""Dataflow over the packed graph: for every value, whether it is per token, per step, or constant.

Seeds are the packed step's per-token values (:meth:`ortpa.rewriter.packed.PagedIO.seeds`: ``input_ids``, the
positions, and what the rewriter itself built per token) and the outputs of the ``PagedAttention`` nodes (the
op reads the sequence boundaries itself). From them a forward pass over the live nodes gives every value a
:class:`Kind` from each op's semantics and the ranks of its inputs, never from names:

* ``const``: no dependence on the step's tokens;
* ``count``: an integer computed from the step's token count (``Shape`` of a per-token value); checked by
  :func:`ortpa.rewriter.per_sequence._token_counts`, which allows it only as a size;
* ``token``: one axis (``axis``) is the packed token axis and each slice along it depends on its own token only;
* ``enum``: like ``token``, but the values hold each token's index in the packed step (``Range(0, count, 1)``, or
  rows ``0..count-1`` of a constant table): alone, a sequence would see its own indices ``0..len-1``. Used only
  to re-index the tokens themselves (``Gather`` on the token axis of a per-token value) it is exact; used as a
  value (learned absolute positions) :mod:`ortpa.rewriter.per_sequence` makes its sources per sequence;
* ``route``: elements that each belong to one token but regrouped across the step (MoE dispatch flattens
  ``[tokens, top_k]``, sorts by expert, and scatters back). Taken to be a permutation of the tokens' own rows,
  which the ops that bring it back to a token axis (``Scatter*``, a ``Reshape`` restoring the token dim) undo;
* ``step``: depends on more than one sequence of the step: ``why`` says how, ``node`` where. An op with no rule
  here and a non-constant input gives ``step``: unknown is step-wide.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import const_array, int_attr, ints_attr

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


CONST = Kind("const")
COUNT = Kind("count")


def _step(node: ir.Node, why: str, definite: bool = True) -> Kind:
    return Kind("step", why=why, node=node, definite=definite)


def _lost(node: ir.Node, why: str) -> Kind:
    """The flow cannot follow the token axis here: unknown, not shown to mix sequences."""
    return _step(node, why, definite=False)


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


def _norm(axis: int, rank: int | None) -> int | None:
    if rank is None:
        return axis if axis >= 0 else None
    return axis % rank if rank else 0


def analyse(
    order: list[ir.Node],
    seeds: dict[ir.Value, Kind],
    trusted: set[ir.Node],
    batch: frozenset[str] = frozenset(),
    dense: frozenset = frozenset(),
) -> Flow:
    """Kinds of every value computed by ``order`` (topological). ``trusted`` nodes (the rewriter's own index
    arithmetic behind the seeds) are not analysed; ``batch``: the dense batch dim's symbols; ``dense``: the
    dense graph's own nodes."""
    flow = Flow(dict(seeds), batch, dense)
    for node in order:
        if node in trusted:
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
    steps = sorted((k for k in ins if k.tag == "step"), key=lambda k: not k.definite)
    if steps:  # the first definite cause is what a refusal names
        return [steps[0]] * n_out
    if node.domain == "com.microsoft" and op == "PagedAttention":
        q = ins[0]
        if q.tag == "route":
            return [_lost(node, "its query's rows are regrouped")] * n_out
        if q.tag == "enum":
            return [Kind("enum", flow.rank(node.outputs[0]) or 2, 0, q.sources)] + [CONST] * (n_out - 1)
        return [Kind("token", flow.rank(node.outputs[0]) or 2, q.axis if q.tag == "token" else 0)] + [CONST] * (
            n_out - 1
        )
    data_tags = {k.tag for k in ins} - {"const", "count"}
    if op == "Range" and not data_tags and ins[1].tag == "count":
        return _range(node, ins, flow)
    if op in ("Slice", "Gather") and not data_tags and ins[0].tag == "const" and any(k.tag == "count" for k in ins[1:]):
        return [_table_rows(node, ins, flow)]
    if not data_tags:
        if op in ("Shape", "Size") or any(k.tag == "count" for k in ins):
            return [COUNT] * n_out
        return [CONST] * n_out
    if op in ("Shape", "Size"):
        return [_shape_kind(node, ins[0], flow)]
    if "route" in data_tags:
        origin = next(k.node for k in ins if k.tag == "route")
        out = _route(node, ins, flow)
        if out.tag == "route":
            out = Kind("route", out.rank, node=origin)
        return [out] * n_out
    handler = _HANDLERS.get(op)
    if handler is not None and node.domain in ("", "ai.onnx", "com.microsoft"):
        return handler(node, ins, flow)
    if op in _ELEMENTWISE:
        return [_broadcast(node, ins, flow)] * n_out
    if op in _LAST_AXES:
        return _last_axes(node, ins, flow)
    if op in _REDUCTIONS:
        return [_reduction(node, ins, flow)] * n_out
    return [_lost(node, f"{node.domain or 'ai.onnx'}::{op} has no per-token rule here (unknown is step-wide)")] * n_out


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
    if k.tag == "enum" and node.op_type not in ("Softmax", "LogSoftmax"):
        k = Kind("token", k.rank, k.axis)
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


def _route(node: ir.Node, ins: list[Kind], flow: Flow) -> Kind:
    """Regrouped rows stay regrouped, except where a scatter puts them back on a per-token tensor's rows (MoE's
    ``index_add``: each row is added to the token its index names)."""
    if node.op_type in ("ScatterND", "ScatterElements") and ins[0].tag == "token":
        return ins[0]
    return Kind("route", flow.rank(node.outputs[0]))


# -- layout ops -------------------------------------------------------------------------------------------------


def _reshape(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    k = ins[0]
    if k.tag not in ("token", "enum") or k.rank is None:
        return [_lost(node, "it reshapes a value whose token axis is unknown")]
    target = const_array(node.inputs[1])
    if target is None:
        target_dims = _shape_elements(node.inputs[1], flow)
    else:
        target_dims = [int(t) for t in target.reshape(-1)]
    if target_dims is None:
        return [_lost(node, "its target shape is neither constant nor read from the tokens")]
    dims = flow.dims(node.inputs[0]) or [None] * k.rank
    if len(dims) != k.rank:
        dims = [None] * k.rank
    lead = dims[: k.axis]
    lead_product = int(np.prod([d for d in lead if d is not None])) if None not in lead else None
    if any(d is None for d in lead) and all(d == 1 or d is None for d in lead):
        lead_product = 1  # the packed batch axis (symbolic in the dense graph) is 1
    out_rank = len(target_dims)
    flags = [int(t) for t in target.reshape(-1)] if target is not None else None
    if flags is not None and not int_attr(node, "allowzero", 0) and len(flags) > k.axis:
        if all(t == 0 for t in flags[: k.axis + 1]):  # leading dims and the token dim copied as they are
            return [replace(k, rank=len(flags), axis=k.axis)]
    target_dims = [
        dims[i] if t == 0 and i < len(dims) and not int_attr(node, "allowzero", 0) else t
        for i, t in enumerate(target_dims)
    ]
    known_in = [d for i, d in enumerate(dims) if i != k.axis]
    if "T" in target_dims and target_dims.count(-1) == 1 and None not in known_in:
        rest = [t for t in target_dims if t not in ("T", -1)]
        if all(isinstance(t, int) and t > 0 for t in rest) and rest is not None:
            total, other = int(np.prod(known_in)), int(np.prod(rest)) if rest else 1
            if other and total % other == 0:
                target_dims = [total // other if t == -1 else t for t in target_dims]
    # where does the token count sit in the target: a "T" element, a copy (0) of the token dim, or the one -1
    for j, t in enumerate(target_dims):
        lead_out = target_dims[:j]
        token_here = t == "T" or (t == 0 and j == k.axis and not int_attr(node, "allowzero", 0)) or t == -1
        if not token_here or any(not isinstance(x, int) or x < 0 for x in lead_out if x != 0):
            continue
        lead_out_vals = [dims[i] if x == 0 and i < len(dims) else x for i, x in enumerate(lead_out)]
        if None in lead_out_vals or lead_product is None:
            continue
        if int(np.prod(lead_out_vals)) == lead_product:
            trail_in = dims[k.axis + 1 :]
            trail_out = target_dims[j + 1 :]
            if t == -1 and (None in trail_in or any(not isinstance(x, int) or x <= 0 for x in trail_out)):
                continue
            if t == -1 and int(np.prod(trail_in)) != int(np.prod(trail_out)):
                continue
            return [replace(k, rank=out_rank, axis=j)]
    blocked = _blocked(k, dims, target_dims, lead_product)
    if blocked is not None:
        return [blocked]
    if node not in flow.dense and flags is not None and flags.count(-1) == 1:
        # the rewriter's own reshapes keep one row per token ([T, heads * d] and back): the -1 is the token dim
        j = flags.index(-1)
        if all(t in (0, 1) for t in flags[:j]) and all(t > 0 for t in flags[j + 1 :]):
            return [replace(k, rank=out_rank, axis=j)]
    if k.tag == "token":
        return [Kind("route", out_rank, node=node)]
    return [_lost(node, "it merges the token axis with others")]


def _blocked(k: Kind, dims: list, target: list, lead_product: int | None) -> Kind | None:
    """A reshape that folds each token's trailing elements into rows of the token axis (or back): each token's
    elements stay one contiguous block, ``block`` rows of it on the new axis (``[1, T, 4*32] -> [1, T*4, 32]``)."""
    trail = dims[k.axis + 1 :]
    if lead_product != 1 or None in trail or target.count(-1) + target.count("T") != 1:
        return None
    per_token = k.block * int(np.prod(trail)) if trail else k.block
    j = target.index(-1) if -1 in target else target.index("T")
    before, after = target[:j], target[j + 1 :]
    if any(t not in (0, 1) for t in before) or any(not isinstance(t, int) or t <= 0 for t in after):
        return None
    size = int(np.prod(after)) if after else 1
    if per_token % size:
        return None
    block = per_token // size
    if target[j] == "T" and block != 1:
        return None
    return replace(k, rank=len(target), axis=j, block=block)


def _shape_elements(value: ir.Value, flow: Flow, depth: int = 0) -> list | None:
    """The elements of a shape vector built from ``Shape`` reads: ints, ``"T"`` (the token count), or None."""
    arr = const_array(value)
    if arr is not None:
        return [int(a) for a in arr.reshape(-1)]
    node = value.producer()
    if node is None or depth > 12:
        return None
    op = node.op_type
    if op == "Concat":
        out: list = []
        for x in node.inputs:
            part = _shape_elements(x, flow, depth + 1)
            if part is None:
                return None
            out += part
        return out
    if op in ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape"):
        inner = _shape_elements(node.inputs[0], flow, depth + 1)
        return inner if inner is not None and len(inner) == 1 else None
    if op == "Shape":
        kind = flow.of(node.inputs[0])
        shape = node.inputs[0].shape
        rank = kind.rank or (len(shape) if shape is not None else None)
        if rank is None:
            return None
        picked = list(range(rank))[slice(int_attr(node, "start", 0), int_attr(node, "end", rank))]
        out = []
        for i in picked:
            if kind.tag in ("token", "enum") and i == kind.axis:
                out.append("T")
            elif shape is not None and len(shape) == rank and flow.dim(shape[i]) is not None:
                out.append(flow.dim(shape[i]))
            elif kind.tag in ("token", "enum") and kind.axis is not None and i < kind.axis:
                out.append(1)  # a symbolic dim before the token axis: the dense batch, 1 once packed
            else:
                out.append(None)
        return out
    if op == "Gather":
        base, idx = _shape_elements(node.inputs[0], flow, depth + 1), const_array(node.inputs[1])
        if base is None or idx is None:
            return None
        return [base[int(i)] for i in idx.reshape(-1)]
    if op == "Slice":
        base = _shape_elements(node.inputs[0], flow, depth + 1)
        bounds = [const_array(x) for x in node.inputs[1:3]]
        if base is None or any(b is None for b in bounds):
            return None
        return base[int(bounds[0].reshape(-1)[0]) : int(bounds[1].reshape(-1)[0])]
    return None


def _squeeze_like(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    k = ins[0]
    if k.tag not in ("token", "enum") or k.rank is None:
        return [_lost(node, "its input's token axis is unknown")]
    arr = const_array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    axes = [int(a) for a in arr.reshape(-1)] if arr is not None else (ints_attr(node, "axes") or [])
    if node.op_type == "Unsqueeze":
        out_rank = k.rank + len(axes)
        axes = sorted(a % out_rank for a in axes)
        axis = k.axis
        for a in axes:
            if a <= axis:
                axis += 1
        return [replace(k, rank=out_rank, axis=axis)]
    if not axes:
        out_rank = flow.rank(node.outputs[0])
        if out_rank is None:
            return [_lost(node, "it squeezes unknown axes")]
        return [replace(k, rank=out_rank, axis=0 if out_rank == 1 else min(k.axis, out_rank - 1))]
    axes = [a % k.rank for a in axes]
    if k.axis in axes:
        return [Kind("enum" if k.tag == "enum" else "token", k.rank - len(axes), None, k.sources)]
    return [replace(k, rank=k.rank - len(axes), axis=k.axis - sum(a < k.axis for a in axes))]


def _transpose(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    k = ins[0]
    if k.rank is None:
        return [_lost(node, "its input's rank is unknown")]
    perm = ints_attr(node, "perm") or list(reversed(range(k.rank)))
    return [replace(k, rank=k.rank, axis=perm.index(k.axis))]


def _keep(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    """Ops acting along one non-token axis (Split, Concat, Slice, Expand, Tile, Pad, Gather on another axis...)."""
    k = next(x for x in ins if x.tag in ("token", "enum"))
    op = node.op_type
    data = ins[0]
    if op == "Concat":
        axis = _norm(int_attr(node, "axis", 0), k.rank)
        aligned = {x.axis for x in ins if x.tag in ("token", "enum")}
        if axis == k.axis or len(aligned) != 1:
            return [_step(node, "it concatenates along the token axis")]
        return [_merge_tags(ins, k.rank, k.axis)]
    if data.tag not in ("token", "enum"):
        return [_step(node, f"its {op} argument other than the data depends on the tokens")] * len(node.outputs)
    if op == "Split":
        axis = _norm(int_attr(node, "axis", 0), k.rank)
        if axis == k.axis:
            return [_step(node, "it splits along the token axis")] * len(node.outputs)
        return [replace(k, rank=k.rank, axis=k.axis)] * len(node.outputs)
    if op == "Slice":
        return [_slice(node, ins, flow)]
    if op in ("Expand", "Tile"):
        out_rank = flow.rank(node.outputs[0]) or k.rank
        return [replace(k, rank=out_rank, axis=k.axis + (out_rank - k.rank))]
    return [replace(k, rank=k.rank, axis=k.axis)] * len(node.outputs)


def _merge_tags(ins: list[Kind], rank: int | None, axis: int | None) -> Kind:
    enum = [x for x in ins if x.tag == "enum"]
    if enum:
        return Kind("enum", rank, axis, frozenset().union(*(x.sources for x in enum)))
    return Kind("token", rank, axis)


def _slice(node: ir.Node, ins: list[Kind], flow: Flow) -> Kind:
    k = ins[0]
    if any(x.tag not in ("const", "count") for x in ins[1:]):
        return _step(node, "its bounds depend on the tokens' values")
    axes_arr = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    if len(node.inputs) > 3 and node.inputs[3] is not None and axes_arr is None:
        return _lost(node, "its axes are computed at run time")
    starts = const_array(node.inputs[1])
    axes = (
        [_norm(int(a), k.rank) for a in axes_arr.reshape(-1)]
        if axes_arr is not None
        else list(range(len(starts.reshape(-1)) if starts is not None else 1))
    )
    if k.axis not in axes:
        return replace(k, rank=k.rank, axis=k.axis)
    j = axes.index(k.axis)
    ends = const_array(node.inputs[2])
    steps = const_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    start = None if starts is None else int(starts.reshape(-1)[j])
    end = None if ends is None else int(ends.reshape(-1)[j])
    step = 1 if steps is None else int(steps.reshape(-1)[j])
    if start == 0 and step == 1 and (end is None or end >= 2**31):  # x[:, 0:] or x[:, :count]: all tokens
        if end is not None or _is_count(node.inputs[2], flow):
            return replace(k, rank=k.rank, axis=k.axis)
    return _step(node, f"it slices the token axis ([{start}:{end}:{step}]): packed, that is other tokens than alone")


def _is_count(value: ir.Value, flow: Flow) -> bool:
    elements = _shape_elements(value, flow)
    return elements is not None and elements == ["T"]


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
        return [_step(node, "both of its operands depend on the tokens (a contraction across them)")]
    if a.tag not in ("token", "enum") or a.rank is None:
        return [_lost(node, "its operand's token axis is unknown")]
    if a.axis == a.rank - 1:
        return [_step(node, "it contracts the token axis")]
    b_rank = flow.rank(node.inputs[1]) or 2
    out_rank = max(a.rank, b_rank)
    return [replace(a, rank=out_rank, axis=a.axis + (out_rank - a.rank))]


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
        if ins[1].tag == "count":  # a sort of every row: a permutation of the tokens' rows (MoE dispatch)
            return [Kind("route", k.rank, node=node)] * len(node.outputs)
        return [_step(node, "TopK picks tokens across the step")] * len(node.outputs)
    if ins[1].tag != "const":
        return [_lost(node, "its k depends on the token count")] * len(node.outputs)
    return [replace(k, sources=k.sources)] * len(node.outputs)


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
    "Range": _range,
    "MatMul": _matmul,
    "Gemm": _matmul,
    "MatMulNBits": _per_token_op,
    "RotaryEmbedding": _per_token_op,
    "MoE": _per_token_op,
    "QMoE": _per_token_op,
}
