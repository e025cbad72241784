"""Layout ops for the per-sequence dataflow: where the token axis goes through Reshape (blocked axes included),
Squeeze / Unsqueeze, Transpose, Concat / Split / Slice / Expand / Tile, GatherND with constant indices, and shape
vectors read with ``Shape``."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import const_array, int_attr, ints_attr
from ortpa.rewriter.per_sequence.kinds import CONST, Flow, Kind
from ortpa.rewriter.per_sequence.kinds import lost as _lost
from ortpa.rewriter.per_sequence.kinds import norm as _norm
from ortpa.rewriter.per_sequence.kinds import step as _step

__all__ = ["gather_nd", "is_count", "keep", "reshape", "shape_elements", "squeeze_like", "static_dims", "transpose"]


def reshape(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    k = ins[0]
    if k.tag not in ("token", "enum") or k.rank is None:
        return [_lost(node, "it reshapes a value whose token axis is unknown")]
    target = const_array(node.inputs[1])
    if target is None:
        target_dims = shape_elements(node.inputs[1], flow)
    else:
        target_dims = [int(t) for t in target.reshape(-1)]
    if target_dims is None:
        return [_lost(node, "its target shape is neither constant nor read from the tokens")]
    dims = static_dims(node.inputs[0], flow) or [None] * k.rank
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
    shapes_known = None not in dims and all(t is not None for t in target_dims)
    if k.tag == "token" and shapes_known:  # a real merge of tokens with other axes
        return [Kind("route", out_rank, node=node)]
    return [_lost(node, "it reshapes the token axis in a way the known shapes cannot tell")]


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


def static_dims(value: ir.Value, flow: Flow, depth: int = 0) -> list[int | None] | None:
    """:meth:`Flow.dims`, with what the graph's own layout ops state where no shape was recovered: a ``Reshape`` to
    a target built from ``Shape`` reads and constants (TorchScript-era exports: optimum), a ``Slice`` with constant
    bounds of a known dim, a ``Transpose``. The token count stays None."""
    known = flow.dims(value)
    node = value.producer()
    if (known is not None and None not in known) or node is None or depth > 8:
        return known
    derived: list[int | None] | None = None
    if node.op_type == "Reshape" and node.domain in ("", "ai.onnx"):
        elems = shape_elements(node.inputs[1], flow)
        if elems is not None and not int_attr(node, "allowzero", 0) and 0 in elems:
            inner = static_dims(node.inputs[0], flow, depth + 1)
            elems = [inner[i] if e == 0 and inner is not None and i < len(inner) else e for i, e in enumerate(elems)]
        if elems is not None:
            derived = [e if isinstance(e, int) and e > 0 else None for e in elems]
    elif node.op_type == "Transpose":
        inner = static_dims(node.inputs[0], flow, depth + 1)
        if inner is not None:
            perm = ints_attr(node, "perm") or list(reversed(range(len(inner))))
            derived = [inner[p] for p in perm] if len(perm) == len(inner) else None
    elif node.op_type == "Slice" and len(node.inputs) >= 4:
        derived = _sliced_dims(node, static_dims(node.inputs[0], flow, depth + 1))
    if derived is None or (known is not None and len(known) != len(derived)):
        return known
    return derived if known is None else [k if k is not None else d for k, d in zip(known, derived, strict=True)]


def _sliced_dims(node: ir.Node, inner: list[int | None] | None) -> list[int | None] | None:
    arrays = [const_array(x) if x is not None else None for x in node.inputs[1:5]]
    if inner is None or any(a is None for a in arrays[:3]):
        return None
    starts, ends, axes = (a.reshape(-1) for a in arrays[:3])
    steps = arrays[3].reshape(-1) if len(arrays) > 3 and arrays[3] is not None else np.ones_like(starts)
    out = list(inner)
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=False):
        a = int(axis) % len(inner)
        if out[a] is not None:
            out[a] = len(range(out[a])[slice(int(start), int(min(end, 2**62)), int(step))])
    return out


def shape_elements(value: ir.Value, flow: Flow, depth: int = 0) -> list | None:
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
            part = shape_elements(x, flow, depth + 1)
            if part is None:
                return None
            out += part
        return out
    if op in ("Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape"):
        inner = shape_elements(node.inputs[0], flow, depth + 1)
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
        base, idx = shape_elements(node.inputs[0], flow, depth + 1), const_array(node.inputs[1])
        if base is None or idx is None:
            return None
        return [base[int(i)] for i in idx.reshape(-1)]
    if op == "Slice":
        base = shape_elements(node.inputs[0], flow, depth + 1)
        bounds = [const_array(x) for x in node.inputs[1:3]]
        if base is None or any(b is None for b in bounds):
            return None
        return base[int(bounds[0].reshape(-1)[0]) : int(bounds[1].reshape(-1)[0])]
    if op in _ARITHMETIC and node.domain in ("", "ai.onnx"):
        # static dims computed on (optimum's interleaved RoPE reshapes to [..., Shape(x)[-1] / 2, 2]); the token
        # count and unknown dims stay unknown through arithmetic
        a, b = (shape_elements(x, flow, depth + 1) for x in node.inputs[:2])
        if a is None or b is None or len(b) != 1 or any(not isinstance(e, int) for e in (*a, *b)):
            return None
        if op == "Div" and b[0] == 0:
            return None
        return [_ARITHMETIC[op](e, b[0]) for e in a]
    return None


_ARITHMETIC = {
    "Add": lambda a, b: a + b,
    "Sub": lambda a, b: a - b,
    "Mul": lambda a, b: a * b,
    "Div": lambda a, b: int(a / b),  # ONNX integer Div truncates
}


def gather_nd(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    """GatherND with constant indices (``batch_dims`` 0) over leading axes other than the token axis: a fixed
    pick per token (e.g. the k and v heads of a fused projection, heads moved to the front); else step-wide."""
    data, idx = ins[0], ins[1]
    indices = const_array(node.inputs[1])
    if data.tag == "const" and idx.tag == "const":
        return [CONST]
    if data.tag == "const" and idx.tag == "token" and int_attr(node, "batch_dims", 0) == 0:
        # a table lookup per token (MoE batched_mm: each (token, expert) row's expert weights)
        idx_rank, data_rank, depth = idx.rank, flow.rank(node.inputs[0]), (flow.dims(node.inputs[1]) or [None])[-1]
        if idx_rank is None or data_rank is None or not isinstance(depth, int):
            return [_lost(node, "ranks unknown")]
        if idx.axis == idx_rank - 1:
            return [_step(node, "its index tuples run along the token axis")]
        return [replace(idx, rank=idx_rank - 1 + data_rank - depth, axis=idx.axis)]
    if idx.tag != "const" or indices is None or indices.ndim < 1 or int_attr(node, "batch_dims", 0) != 0:
        return [_step(node, "its indices are not constant (or it has batch dims)")]
    if data.tag not in ("token", "enum"):
        return [_step(node, "its data is not per token")]
    if data.rank is None:
        return [_lost(node, "ranks unknown")]
    depth = int(indices.shape[-1])  # how many leading data axes each index row addresses
    if data.axis < depth:
        return [_step(node, "it picks fixed tokens of the packed step")]
    lead = indices.ndim - 1
    return [replace(data, rank=lead + data.rank - depth, axis=lead + data.axis - depth)]


def squeeze_like(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
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


def transpose(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
    k = ins[0]
    if k.rank is None:
        return [_lost(node, "its input's rank is unknown")]
    perm = ints_attr(node, "perm") or list(reversed(range(k.rank)))
    return [replace(k, rank=k.rank, axis=perm.index(k.axis))]


def keep(node: ir.Node, ins: list[Kind], flow: Flow) -> list[Kind]:
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
        if end is not None or is_count(node.inputs[2], flow):
            return replace(k, rank=k.rank, axis=k.axis)
    return _step(node, f"it slices the token axis ([{start}:{end}:{step}]): packed, that is other tokens than alone")


def is_count(value: ir.Value, flow: Flow) -> bool:
    elements = shape_elements(value, flow)
    return elements is not None and elements == ["T"]
