"""MoE dispatch by selection in the per-sequence dataflow: ``NonZero`` of a per-token mask picks the rows an expert
computes, and a gather / scatter by the selected tokens' own indices reads them and puts them back.

transformers 4.x's eager MoE (DeepSeek-V3, as optimum traces it) builds ``one_hot(top-k experts)`` per token, then
per expert ``token, slot = where(mask[expert])``, computes the expert on ``x[token]`` weighted by
``weights[token, slot]``, and ``index_add``s the rows back at ``token``. Which elements ``NonZero`` selects depends
on each element's own token (the mask is per token), but its output holds *positions* in the packed step: used as
values they would leak, used as indices they are exact when each selected row reads and writes its own token.

Role ``coords`` (a :class:`~ortpa.rewriter.per_sequence.kinds.Kind` tagged ``route``, ``node`` the ``NonZero``):
the coordinates and what layout ops and arithmetic compute from them alone. A ``Gather`` of a per-token value along
the tokens at such an index gives role ``rows`` when, evaluated on sample coordinates (the first tokens of a step
and tokens past any step's count), every row's index falls in the token it was selected from; a
``ScatterElements`` / ``ScatterND`` of ``rows`` along the tokens of a constant-filled (or per-token) tensor, at an
index that is each row's own token, is per token again. Anything else is the general rules of
:mod:`ortpa.rewriter.per_sequence.routes` (rows combined with rows in token order, positions used as values: a
definite leak).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import const_array, int_attr, ints_attr
from ortpa.rewriter.per_sequence.arith import elementwise
from ortpa.rewriter.per_sequence.kinds import Flow, Kind, lost, norm, step

__all__ = ["COORDS", "SPECIAL", "gather", "nonzero", "scatter"]

COORDS = "coords"
_SAMPLE_TOKENS = 16
_FAR_TOKEN = 2**24  # past any step's token count: an offset or a clamp in the index differs there
_MAX_ELEMENTS = 1 << 16  # sample elements per token axis pass (the mask's other dims are small: experts, top-k)


def nonzero(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    """``NonZero`` of a per-token mask: the coordinates of its selected elements (``[rank, N]``, rows on axis 1)."""
    k = ins[0]
    if k.tag != "token" or k.rank is None or k.block != 1:
        return [lost(node, "it selects from a value whose token axis is unknown")]
    dims = flow.dims(node.inputs[0])
    if dims is None or any(d is None for i, d in enumerate(dims) if i != k.axis):
        return [lost(node, "it selects from a value whose dims other than the tokens are not static")]
    return [Kind("route", 2, 1, node=node, role=COORDS)]


def gather(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind] | None:
    """``Gather`` along the tokens of a per-token value at an index computed from the coordinates."""
    data, idx = ins[0], ins[1]
    if node.op_type != "Gather" or data.tag != "token" or data.rank is None or idx.rank != 1:
        return None
    axis = norm(int_attr(node, "axis", 0), data.rank)
    if axis != data.axis:
        return None
    if _own_token(node.inputs[1], idx.node, data.block, flow):
        return [Kind("route", data.rank, axis, node=idx.node, role="rows")]
    return [step(node, f"it reads rows of other tokens than those {idx.node.name!r} selected")]


def scatter(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind] | None:
    """Selected rows written (or added) back along the tokens, each at its own token."""
    data, idx, upd = ins[0], ins[1], ins[2]
    if upd.tag != "route" or upd.role != "rows" or upd.node is not idx.node:
        return None
    rank = data.rank if data.tag == "token" else flow.rank(node.inputs[0])
    if rank is None:
        return None
    if node.op_type == "ScatterElements":
        axis, index = norm(int_attr(node, "axis", 0), rank), node.inputs[1]
    else:  # ScatterND: one leading coordinate per update row
        dims = flow.dims(node.inputs[1])
        if not dims or dims[-1] != 1:
            return None
        axis, index = 0, node.inputs[1]
    if data.tag == "token":
        if data.axis != axis or data.block != 1:
            return None
    elif not _filled(node.inputs[0]):
        return None
    if axis != 0 or upd.axis != 0:
        return None
    if _own_token(index, idx.node, 1, flow):
        return [Kind("token", rank, 0)]
    return [step(node, f"it writes the rows {idx.node.name!r} selected onto other tokens than their own")]


def _filled(value: ir.Value) -> bool:
    """A tensor of one constant value in the step's shape (``ConstantOfShape``: the zeros ``index_add`` adds to)."""
    node = value.producer()
    return node is not None and node.op_type == "ConstantOfShape"


def _own_token(index: ir.Value, selection: ir.Node, block: int, flow: Flow) -> bool:
    """``index``, evaluated on sample coordinates of ``selection``, is each selected row's own token (``block``
    rows per token in the data it indexes)."""
    sample = _sample(selection, flow)
    if sample is None:
        return False
    coords, token = sample
    f = _evaluate(index, selection.outputs[0], coords)
    if f is None or f.ndim == 0 or f.shape[0] != token.shape[0] or not np.issubdtype(f.dtype, np.integer):
        return False
    rows = f.reshape(f.shape[0], -1).astype(np.int64) // block
    return bool(np.all(rows == token[:, None]))


def _sample(selection: ir.Node, flow: Flow) -> tuple[np.ndarray, np.ndarray] | None:
    """Coordinates ``[rank, N]`` of every element of a sample mask (tokens ``0..15`` and ``2**24..2**24+15``), and
    each element's token."""
    kind = flow.of(selection.inputs[0])
    dims = flow.dims(selection.inputs[0])
    if dims is None or kind.axis is None:
        return None
    shape = [_SAMPLE_TOKENS * 2 if i == kind.axis else d for i, d in enumerate(dims)]
    if any(d is None for d in shape) or int(np.prod(shape)) > _MAX_ELEMENTS:
        return None
    coords = np.indices(shape).reshape(len(shape), -1).astype(np.int64)
    tokens = np.concatenate([np.arange(_SAMPLE_TOKENS), _FAR_TOKEN + np.arange(_SAMPLE_TOKENS)]).astype(np.int64)
    coords[kind.axis] = tokens[coords[kind.axis]]
    return coords, coords[kind.axis].copy()


def _evaluate(value: ir.Value, coords_value: ir.Value, coords: np.ndarray, depth: int = 0) -> np.ndarray | None:
    """``value`` computed from the coordinates (given as ``coords``) and constants alone, with numpy; else None."""
    if value is coords_value:
        return coords
    arr = const_array(value)
    if arr is not None:
        return arr
    node = value.producer()
    if node is None or depth > 24 or node.domain not in ("", "ai.onnx") or not node.inputs:
        return None
    # Expand's shape is read from the rows at run time: broadcasting, compared column by column
    inputs = node.inputs[:1] if node.op_type == "Expand" else node.inputs
    args = [None if v is None else _evaluate(v, coords_value, coords, depth + 1) for v in inputs]
    if args[0] is None:
        return None
    try:
        return _apply(node, value, args)
    except (ValueError, IndexError, TypeError):
        return None


def _apply(node: ir.Node, value: ir.Value, args: list[np.ndarray | None]) -> np.ndarray | None:
    op, x = node.op_type, args[0]
    assert x is not None
    second = args[1] if len(args) > 1 else None
    if op in ("Identity", "Expand"):
        return x
    if op == "Transpose":
        perm = ints_attr(node, "perm")
        return np.transpose(x, perm) if perm else x.T
    if op in ("Squeeze", "Unsqueeze"):
        axes = [int(a) for a in second.reshape(-1)] if second is not None else ints_attr(node, "axes")
        if axes is None:
            return np.squeeze(x) if op == "Squeeze" else None
        if op == "Squeeze":
            return np.squeeze(x, axis=tuple(norm(a, x.ndim) for a in axes))
        for a in sorted(norm(a, x.ndim + len(axes)) for a in axes):
            x = np.expand_dims(x, a)
        return x
    if op == "Split":
        axis = norm(int_attr(node, "axis", 0), x.ndim)
        sizes = [int(s) for s in second.reshape(-1)] if second is not None else [x.shape[axis] // len(node.outputs)]
        sizes = sizes * len(node.outputs) if len(sizes) == 1 else sizes
        return np.split(x, np.cumsum(sizes)[:-1], axis=axis)[value.index()]
    if op == "Reshape" and second is not None:
        target = [int(t) for t in second.reshape(-1)]
        return x.reshape([x.shape[i] if t == 0 else t for i, t in enumerate(target)])
    if op == "Gather" and second is not None:
        return np.take(x, second.astype(np.int64), axis=norm(int_attr(node, "axis", 0), x.ndim))
    return elementwise(node, args)


# the rules routes.transfer applies where an input holds a selection's coordinates
SPECIAL = {"Gather": gather, "ScatterElements": scatter, "ScatterND": scatter}
