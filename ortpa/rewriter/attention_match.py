"""Structural matcher for dense MHA / GQA attention layers (see :mod:`ortpa.rewriter.attention`).

Anchored on the cache I/O names ``past_key_values.{i}.key``/``.value``: from each cache ``Concat`` forward to the
attention that reads it (through repeat_kv), back from there to the query, the scores' scale / softcap / mask,
and back from q / k to RoPE and an optional per-head RMSNorm. Never mutates the graph; every failed check is an
onnxscript ``MatchResult`` with a reason and the value it concerns, reported per layer as a ``LayerFailure``.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import const_array, consumers, int_attr, ints_attr, producer_op, scalar, static_dim
from ortpa.rewriter._match import (
    LayerFailure,
    MatchFail,
    cache_concat,
    cache_inputs,
    cache_layers,
    consumer_ops,
    match_or_failure,
    need,
    softmax_of,
    strip_scales,
)

__all__ = [
    "AttentionLayer",
    "LayerFailure",
    "QkNorm",
    "match_attention_layer",
    "match_attention_layers",
    "rope_in_op_problems",
]

_MAX_MASK_NODES = 400  # the mask subgraph of a tiny or a 70B model is the same few dozen nodes


@dataclass(frozen=True)
class QkNorm:
    """An RMSNorm over the head dimension of q or k (Qwen3): ``x * rsqrt(mean(x^2) + eps) * weight``."""

    input: ir.Value  # [B,S,heads,D], before the norm
    weight: np.ndarray  # [D]
    epsilon: float


@dataclass
class AttentionLayer:
    """One matched dense MHA / GQA attention; values refer to the graph it was matched in."""

    layer: int
    num_heads: int  # H
    kv_num_heads: int  # KVH
    head_size: int  # D
    scale: float
    softcap: float  # 0 = none
    local_window_size: int  # -1 = none; else the window including the current token
    query: ir.Value  # [B,H,S,D] as the attention reads it (rotated, scale factors stripped)
    key: ir.Value  # [B,KVH,S,D] new keys as cached (rotated)
    value: ir.Value  # [B,KVH,S,D] new values
    attn_out: ir.Value  # [B,H,S,D]
    query_raw: ir.Value | None = None  # [B,H,S,D] before RoPE (and after q_norm), when RoPE was recognised
    key_raw: ir.Value | None = None
    q_norm: QkNorm | None = None
    k_norm: QkNorm | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def rope_recognised(self) -> bool:
        return self.query_raw is not None and self.key_raw is not None


def _repeated(present: ir.Value) -> list[ir.Value]:
    """``present`` and what repeat_kv makes of it (Unsqueeze -> Expand -> Reshape), in that order."""
    found = [present]
    for unsq in consumers(present, "Unsqueeze"):
        for exp in consumers(unsq.outputs[0], "Expand"):
            found += [r.outputs[0] for r in consumers(exp.outputs[0], "Reshape")]
    return found


def _reaches(start: ir.Value, target: ir.Value, max_nodes: int = 60) -> bool:
    seen: set[int] = set()
    queue = deque([start])
    while queue and len(seen) < max_nodes:
        value = queue.popleft()
        if value is target:
            return True
        node = value.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        queue.extend(v for v in node.inputs if v is not None and v.const_value is None)
    return False


@dataclass
class _Scores:
    matmul: ir.Node
    scale: float
    softcap: float
    masks: list[ir.Value]


def _scores(value: ir.Value) -> _Scores:
    """Softmax input -> ``[mask +] softcap*tanh(f*qk/softcap) | f*qk`` -> MatMul(q, k^T)."""
    masks: list[ir.Value] = []
    outer = 1.0
    for _ in range(12):
        node = value.producer()
        need(node is not None and node.domain in ("", "ai.onnx"), "Softmax input is not computed from q @ k^T", value)
        assert node is not None
        if node.op_type == "Cast":
            value = node.inputs[0]
        elif node.op_type == "Add":
            a, b = node.inputs
            # the scores side leads back to a MatMul through few nodes; the mask side to the mask subgraph
            first = a if _reaches_op(a, "MatMul", "Tanh") else b
            masks.append(b if first is a else a)
            value = first
        elif node.op_type in ("Mul", "Div"):
            base, f = strip_scales(value)
            need(base is not value, f"{node.op_type} on the scores by a non-constant", node)
            tanh = producer_op(base, "Tanh")
            if tanh is not None:
                inner_base, inner = strip_scales(tanh.inputs[0])
                mm = producer_op(inner_base, "MatMul")
                need(mm is not None, "Tanh (softcap) input is not scale * (q @ k^T)", tanh)
                assert mm is not None
                # outer * f * tanh(inner * qk): softcap = outer * f, scale = inner * softcap
                cap = outer * f
                need(cap > 0, f"softcap factor {cap} is not positive", node)
                return _Scores(mm, inner * cap, cap, masks)
            outer *= f
            value = base
        elif node.op_type == "MatMul":
            return _Scores(node, outer, 0.0, masks)
        else:
            raise MatchFail(f"Softmax input is not scale * (q @ k^T) [+ mask]: found {node.op_type}", node)
    raise MatchFail("Softmax input: too many nodes before q @ k^T", value)


def _reaches_op(value: ir.Value, *op_types: str, depth: int = 6) -> bool:
    for _ in range(depth):
        node = value.producer()
        if node is None:
            return False
        if node.op_type in op_types:
            return True
        if node.op_type not in ("Mul", "Div", "Cast", "Tanh") or not node.inputs:
            return False
        value = node.inputs[0] if scalar(node.inputs[0]) is None else node.inputs[1]
    return False


@dataclass
class _Core:
    query: ir.Value
    key: ir.Value
    value: ir.Value  # the (repeated) value the attention reads, [B,H,T,D]
    attn_out: ir.Value
    scale: float | None  # None: the op's default 1/sqrt(D)
    softcap: float
    masks: list[ir.Value]
    kind: str


def _attention_core(present_v: ir.Value) -> _Core:
    """The attention reading the (repeated) value cache: MatMul(Softmax(...), v) or ONNX Attention."""
    for v in _repeated(present_v):
        for node in consumers(v):
            if node.op_type == "Attention" and node.domain in ("", "ai.onnx") and len(node.inputs) > 2:
                if node.inputs[2] is not v:
                    continue
                need(
                    len(node.inputs) < 5 or all(x is None for x in node.inputs[4:]),
                    "ONNX Attention with past_key/past_value inputs: expected the cache as explicit Concat",
                    node,
                )
                need(int_attr(node, "qk_matmul_output_mode", 0) == 0, "ONNX Attention returns qk scores", node)
                need(
                    len(node.outputs) == 1 or all(not o.uses() for o in node.outputs[1:]),
                    "Attention extra outputs used",
                    node,
                )
                attr = node.attributes.get("scale")
                query, qf = strip_scales(node.inputs[0])
                key, kf = strip_scales(node.inputs[1])
                scale = float(attr.value) if attr is not None else None
                if qf * kf != 1.0:  # scalar factors on q / k outside the node multiply its (default) scale
                    d = static_dim(query, -1)
                    need(d is not None, "query head size is not static", query)
                    assert d is not None
                    scale = (scale if scale is not None else 1.0 / math.sqrt(d)) * qf * kf
                softcap = float(node.attributes["softcap"].value) if node.attributes.get("softcap") else 0.0
                masks = [node.inputs[3]] if len(node.inputs) > 3 and node.inputs[3] is not None else []
                if int_attr(node, "is_causal", 0) == 0:
                    need(masks, "ONNX Attention without a mask and is_causal=0 is not causal attention", node)
                return _Core(query, key, v, node.outputs[0], scale, softcap, masks, "onnx-attention")
            if node.op_type == "MatMul" and node.inputs[1] is v:
                softmax = softmax_of(node.inputs[0])
                need(softmax is not None, f"MatMul({node.inputs[0].name}, v): probabilities are not a Softmax", node)
                assert softmax is not None
                need(int_attr(softmax, "axis", -1) in (-1, 3), "Softmax is not over the last axis", softmax)
                s = _scores(softmax.inputs[0])
                query, qf = strip_scales(s.matmul.inputs[0])
                key, kf = strip_scales(s.matmul.inputs[1], through_layout=True)
                # factors on q / k scale q.k inside the tanh too: they belong to scale, not to softcap
                return _Core(query, key, v, node.outputs[0], s.scale * qf * kf, s.softcap, s.masks, "matmul-softmax")
    raise MatchFail(
        f"no attention (MatMul(p, v) or ONNX Attention) reads the value cache; consumers: {consumer_ops(present_v)}",
        present_v,
    )


def _ancestors(values: list[ir.Value], limit: int = _MAX_MASK_NODES) -> list[ir.Node]:
    seen: dict[int, ir.Node] = {}
    queue = deque(values)
    while queue and len(seen) < limit:
        node = queue.popleft().producer()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        queue.extend(v for v in node.inputs if v is not None and v.const_value is None)
    return list(seen.values())


def _int_scalar(value: ir.Value | None) -> int | None:
    arr = const_array(value)
    if arr is None or arr.size != 1 or arr.dtype.kind not in "iu":
        return None
    return int(arr.reshape(()))


def _offset(value: ir.Value) -> int | None:
    """c when ``value = x - c`` or ``x + (-c)`` with a constant integer c, else None."""
    node = producer_op(value, "Sub", "Add")
    if node is None or len(node.inputs) != 2:
        return None
    c = _int_scalar(node.inputs[1])
    if c is None and node.op_type == "Add":
        c = _int_scalar(node.inputs[0])
        return None if c is None else -c
    if c is None:
        return None
    return c if node.op_type == "Sub" else -c


def _sliding_window(masks: list[ir.Value]) -> int:
    """The window the mask encodes, as local_window_size (-1 = none): ``kv > q - W`` (transformers' sliding mask).

    Comparisons of the form ``kv > q - c`` / ``q - c < kv`` give ``W = c``; ``kv >= q - c`` / ``q - c <= kv``
    give ``W = c + 1``. Two different windows in one layer's mask are reported, never guessed.
    """
    windows: set[int] = set()
    for node in _ancestors(masks):
        if node.op_type not in ("Greater", "GreaterOrEqual", "Less", "LessOrEqual") or len(node.inputs) != 2:
            continue
        a, b = node.inputs
        # normalise to "kv OP (q - c)" with OP in {>, >=}
        if node.op_type in ("Greater", "GreaterOrEqual"):
            kv, shifted, strict = a, b, node.op_type == "Greater"
        else:
            kv, shifted, strict = b, a, node.op_type == "Less"
        c = _offset(shifted)
        if c is None or c <= 0 or const_array(kv) is not None:
            continue
        windows.add(c if strict else c + 1)
    need(
        len(windows) <= 1, f"the attention mask encodes several windows {sorted(windows)}", masks[0] if masks else None
    )
    return windows.pop() if windows else -1


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
            eps = scalar(add.inputs[1])
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


def _rope_input(roped: ir.Value, head: int) -> ir.Value | None:
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


def _before_transpose_norm(raw: ir.Value) -> QkNorm | None:
    """The RMSNorm on ``[B,S,heads,D]`` right before Transpose(0,2,1,3) producing ``raw``, if any."""
    t = producer_op(raw, "Transpose")
    if t is None or ints_attr(t, "perm") != [0, 2, 1, 3]:
        return None
    return _rms_norm(t.inputs[0])


def match_attention_layer(graph: ir.Graph, layer: int) -> AttentionLayer | LayerFailure:
    """Match the dense MHA / GQA attention of ``layer``; never mutates the graph."""
    return match_or_failure(_match, graph, layer)


def _match(graph: ir.Graph, i: int) -> AttentionLayer:
    past_k, past_v = cache_inputs(graph, i)
    need(
        past_k.shape is not None and len(past_k.shape) == 4,
        f"key cache is not [batch, heads, past, head]: {past_k.shape}",
        past_k,
    )
    kvh, d = static_dim(past_k, 1), static_dim(past_k, 3)
    need(kvh is not None and d is not None, f"key cache heads / head size are not static: {past_k.shape}", past_k)
    assert kvh is not None and d is not None
    need(
        (static_dim(past_v, 1), static_dim(past_v, 3)) == (kvh, d),
        f"value cache {past_v.shape} differs from key cache {past_k.shape} in heads or head size (not MHA/GQA)",
        past_v,
    )
    present_k, k_new = cache_concat(past_k)
    present_v, v_new = cache_concat(past_v)
    core = _attention_core(present_v)
    need(_reaches(core.key, present_k), f"attention key does not come from the key cache {present_k.name}", core.key)
    h = static_dim(core.query, 1)
    need(h is not None, f"query heads are not static: {core.query.shape}", core.query)
    assert h is not None
    need(
        static_dim(core.query, -1) in (None, d),
        f"query head size {static_dim(core.query, -1)}, cache head size {d}",
        core.query,
    )
    need(h % kvh == 0, f"{h} query heads are not a multiple of {kvh} KV heads", core.query)
    # the key may reach the scores transposed / reshaped: its heads are checked through the repeated value
    for what, v in (("value", core.value), ("output", core.attn_out)):
        got = static_dim(v, 1)
        need(got in (None, h), f"attention {what} has {got} heads, query has {h}", v)
    for what, v in (("key", k_new), ("value", v_new)):
        need(static_dim(v, 1) in (None, kvh), f"new {what} has {static_dim(v, 1)} heads, cache has {kvh}", v)
    need(d % 8 == 0, f"head size {d} is not a multiple of 8 (PagedAttention)", past_k)
    window = _sliding_window(core.masks)

    scale = core.scale if core.scale is not None else 1.0 / math.sqrt(d)
    m = AttentionLayer(
        layer=i,
        num_heads=h,
        kv_num_heads=kvh,
        head_size=d,
        scale=scale,
        softcap=core.softcap,
        local_window_size=window,
        query=core.query,
        key=k_new,
        value=v_new,
        attn_out=core.attn_out,
        notes=[core.kind],
    )
    q_raw, k_raw = _rope_input(core.query, d), _rope_input(k_new, d)
    if q_raw is not None and k_raw is not None:
        m.query_raw, m.key_raw = q_raw, k_raw
        m.q_norm, m.k_norm = _before_transpose_norm(q_raw), _before_transpose_norm(k_raw)
    return m


def match_attention_layers(graph: ir.Graph) -> list[AttentionLayer | LayerFailure]:
    """Match every layer that has ``past_key_values.{i}.key`` inputs, in layer order."""
    return [match_attention_layer(graph, i) for i in cache_layers(graph)]


def rope_in_op_problems(m: AttentionLayer) -> list[str]:
    """Why RoPE (and q/k norm) of ``m`` cannot move into the op; empty when it can."""
    problems = []
    if not m.rope_recognised:
        problems.append("RoPE not recognised as full-width rotate_half (x*cos + rotate_half(x)*sin) on q and k")
    if m.head_size % 16:
        problems.append(f"head size {m.head_size} is not a multiple of 16 (do_rotary=1)")
    if (m.q_norm is None) != (m.k_norm is None):
        problems.append("only one of q / k has an RMSNorm before RoPE")
    if m.q_norm is not None and m.k_norm is not None and m.q_norm.epsilon != m.k_norm.epsilon:
        problems.append(f"q / k norm epsilons differ ({m.q_norm.epsilon} vs {m.k_norm.epsilon}): the op has one")
    return problems
