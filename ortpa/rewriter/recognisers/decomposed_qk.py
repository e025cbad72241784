"""What q and k go through before a dense attention, for :mod:`ortpa.rewriter.recognisers.decomposed`.

Full-width rotate_half RoPE (``x * cos + rotate_half(x) * sin``, or ONNX ``RotaryEmbedding``) and a per-head
RMSNorm (Qwen3's q_norm / k_norm, or ONNX ``RMSNormalization``) right before the heads' Transpose: what
``rope_in_op=True`` can move into PagedAttention. Each function returns ``None`` when the pattern is not there;
none mutates the graph.
"""

from __future__ import annotations

import onnx_ir as ir

from ortpa.rewriter._fold import folded_scalar
from ortpa.rewriter._graph import const_array, int_attr, ints_attr, producer_op, scalar, static_dim
from ortpa.rewriter.layer import QkNorm

__all__ = ["before_transpose_norm", "rope_input"]


def _rms_norm(value: ir.Value) -> QkNorm | None:
    """``weight * (x * Reciprocal(Sqrt(ReduceMean(x^2, -1) + eps)))`` (either Mul order), or ONNX RMSNormalization."""
    rms = producer_op(value, "RMSNormalization")
    if rms is not None:
        weight = const_array(rms.inputs[1]) if len(rms.inputs) > 1 else None
        attr = rms.attributes.get("epsilon")
        if weight is None or weight.ndim != 1 or int_attr(rms, "axis", -1) not in (-1, 3):
            return None
        return QkNorm(rms.inputs[0], weight, float(attr.value) if attr is not None else 1e-5)
    outer = producer_op(value, "Mul")
    if outer is None:
        return None
    for w_in, inner_in in ((outer.inputs[0], outer.inputs[1]), (outer.inputs[1], outer.inputs[0])):
        weight = const_array(w_in)
        inner = producer_op(inner_in, "Mul")
        if weight is None or weight.ndim != 1 or inner is None:
            continue
        for x, r in ((inner.inputs[0], inner.inputs[1]), (inner.inputs[1], inner.inputs[0])):
            rec = producer_op(r, "Reciprocal")
            sqrt = producer_op(rec.inputs[0], "Sqrt") if rec else None
            add = producer_op(sqrt.inputs[0], "Add") if sqrt else None
            if add is None:
                continue
            eps_arr = folded_scalar(add.inputs[1])  # a constant, or folded from static shapes
            eps = None if eps_arr is None else float(eps_arr)
            mean = producer_op(add.inputs[0], "ReduceMean")
            pow_ = producer_op(mean.inputs[0], "Pow") if mean else None
            if eps is None or pow_ is None or pow_.inputs[0] is not x or scalar(pow_.inputs[1]) != 2.0:
                continue
            axes = const_array(mean.inputs[1]) if len(mean.inputs) > 1 else None
            if axes is None or axes.reshape(-1).tolist() != [-1] or int_attr(mean, "keepdims", 1) != 1:
                continue
            if static_dim(x, -1) not in (None, weight.shape[0]):
                continue
            return QkNorm(x, weight, eps)
    return None


def rope_input(roped: ir.Value, head: int) -> ir.Value | None:
    """x when ``roped = x * cos + Concat(-x[..., D/2:], x[..., :D/2]) * sin`` (full-width rotate_half), else None.

    Also ONNX ``RotaryEmbedding`` (opset-23 exports), non-interleaved over the whole head.
    """
    rot = producer_op(roped, "RotaryEmbedding")
    if rot is not None:
        full = int_attr(rot, "rotary_embedding_dim", 0) in (0, head)
        plain = int_attr(rot, "interleaved", 0) == 0 and (len(rot.inputs) < 4 or rot.inputs[3] is None)
        return rot.inputs[0] if full and plain and static_dim(rot.inputs[0], 1) is not None else None
    add = producer_op(roped, "Add")
    if add is None:
        return None
    for m1, m2 in ((add.inputs[0], add.inputs[1]), (add.inputs[1], add.inputs[0])):
        mul_cos, mul_sin = producer_op(m1, "Mul"), producer_op(m2, "Mul")
        if mul_cos is None or mul_sin is None:
            continue
        for rot_in in mul_sin.inputs:
            concat = producer_op(rot_in, "Concat")
            if concat is None or len(concat.inputs) != 2 or int_attr(concat, "axis") not in (-1, 3):
                continue
            neg = producer_op(concat.inputs[0], "Neg")
            hi = producer_op(neg.inputs[0], "Slice") if neg else None
            lo = producer_op(concat.inputs[1], "Slice")
            if hi is None or lo is None or hi.inputs[0] is not lo.inputs[0]:
                continue
            x = hi.inputs[0]
            if x not in mul_cos.inputs:
                continue
            starts_hi, starts_lo = const_array(hi.inputs[1]), const_array(lo.inputs[1])
            ends_lo = const_array(lo.inputs[2])
            if starts_hi is None or starts_lo is None or ends_lo is None:
                continue
            if int(starts_hi.reshape(-1)[0]) != head // 2 or int(starts_lo.reshape(-1)[0]) != 0:
                continue
            if int(ends_lo.reshape(-1)[0]) != head // 2:
                continue
            return x
    return None


def before_transpose_norm(raw: ir.Value) -> QkNorm | None:
    """The RMSNorm on ``[B,S,heads,D]`` right before Transpose(0,2,1,3) producing ``raw``, if any."""
    t = producer_op(raw, "Transpose")
    if t is None or ints_attr(t, "perm") != [0, 2, 1, 3]:
        return None
    return _rms_norm(t.inputs[0])
