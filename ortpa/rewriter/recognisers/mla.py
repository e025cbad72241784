"""Structural matcher for dense MLA attention in ONNX exports (see :mod:`ortpa.rewriter.mla`).

Two cache forms: transformers 5 caches the normalised latent and the roped k_pe (one head each) and expands the
whole present latent through kv_b_proj; transformers 4.x (optimum) caches the expanded per-head keys
``Concat(k_nope, Expand(k_pe))`` and values, computed by kv_b_proj from the new latent rows only. Both are traced
to the same parts (the new latent rows, the roped k_pe, kv_b_proj) and absorbed alike: the paged cache holds the
latent whatever the export cached.

Anchored on the cache I/O names ``past_key_values.{i}.key`` / ``.value``; walks to the kv_b_proj expansion, the
attention core (MatMul/Softmax in SDPA and eager exports, ONNX ``Attention`` at opset 23), the query
``Concat(q_nope, q_pe)``, RoPE inputs and the o_proj. Every failed check is an onnxscript ``MatchResult`` with a
reason and the value or node it concerns; :func:`match_mla_layer` never mutates the graph.
"""

from __future__ import annotations

import math
from collections import deque

import onnx_ir as ir

from ortpa.rewriter._graph import (
    const_array,
    consumers,
    int_attr,
    ints_attr,
    producer_op,
    split_sizes,
    static_dim,
)
from ortpa.rewriter.layer import LayerFailure, MlaLayer
from ortpa.rewriter.recognisers._match import (
    MatchFail,
    cache_inputs,
    cache_layers,
    consumer_ops,
    match_or_failure,
    need,
    softmax_of,
    strip_scales,
)
from ortpa.rewriter.recognisers.decomposed_core import past_row_zeroing
from ortpa.rewriter.recognisers.mla_caches import (
    CachedParts,
    describe_value,
    expanded_cache,
    find_k_pe_raw,
    latent_cache,
)

__all__ = ["match_mla_layer", "match_mla_layers"]


def _reaches(start: ir.Value, targets: set[int], max_nodes: int = 400) -> bool:
    """Whether a backward walk from ``start`` meets a value whose id is in ``targets``."""
    seen: set[int] = set()
    queue = deque([start])
    while queue and len(seen) < max_nodes:
        value = queue.popleft()
        if id(value) in targets:
            return True
        node = value.producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        queue.extend(v for v in node.inputs if v is not None)
    return False


def _scores_matmul(value: ir.Value, depth: int = 8) -> tuple[ir.Node, float] | None:
    """From the Softmax input back to MatMul(q, k^T): skip Add(mask), Cast and scalar Mul/Div; collect scale."""
    if depth == 0:
        return None
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "MatMul":
        return node, 1.0
    if node.op_type == "Cast":
        return _scores_matmul(node.inputs[0], depth - 1)
    if node.op_type == "Add":
        for inp in node.inputs:
            found = _scores_matmul(inp, depth - 1)
            if found is not None:
                return found
        return None
    if node.op_type in ("Mul", "Div"):
        base, factor = strip_scales(value)
        if base is value:
            return None
        found = _scores_matmul(base, depth - 1)
        return None if found is None else (found[0], found[1] * factor)
    return None


def _attention_core(v: ir.Value, head_qk: int) -> tuple[ir.Value, ir.Value, ir.Value, float, str]:
    """Find the attention reading ``v``; return (query, key, attn_out, scale, kind)."""
    for node in consumers(v):
        if node.op_type == "Attention" and node.domain in ("", "ai.onnx") and len(node.inputs) > 2:
            if node.inputs[2] is not v:
                continue
            need(
                not node.attributes.get("softcap") or float(node.attributes["softcap"].value) == 0.0,
                "ONNX Attention with softcap is not an MLA pattern ortpa converts",
                node,
            )
            need(int_attr(node, "is_causal", 0) in (0, 1), "unexpected is_causal", node)
            need(
                len(node.inputs) < 5 or all(x is None for x in node.inputs[4:]),
                "ONNX Attention with past_key/past_value inputs: the cache must be the explicit MLA latent",
                node,
            )
            attr = node.attributes.get("scale")
            scale = float(attr.value) if attr is not None else 1.0 / math.sqrt(head_qk)
            query, qf = strip_scales(node.inputs[0])
            return query, node.inputs[1], node.outputs[0], scale * qf, "onnx-attention"
        if node.op_type == "MatMul" and node.inputs[1] is v:
            softmax = softmax_of(node.inputs[0])
            need(softmax is not None, f"MatMul({node.inputs[0].name}, v): probabilities are not a Softmax", node)
            need(int_attr(softmax, "axis", -1) in (-1, 3), "Softmax is not over the last axis", softmax)
            found = _scores_matmul(softmax.inputs[0])
            need(found is not None, "Softmax input is not scale * (q @ k^T) [+ mask]", softmax)
            qk, s_scores = found
            query, s_q = strip_scales(qk.inputs[0])
            key, s_k = strip_scales(qk.inputs[1], through_layout=True)
            # transformers 5's SDPA exports zero fully masked rows after the attention (none under a causal mask)
            return query, key, past_row_zeroing(node.outputs[0]), s_scores * s_q * s_k, "matmul-softmax"
    raise MatchFail(f"no attention (MatMul(p, v) or ONNX Attention) consumes v; consumers: {consumer_ops(v)}", v)


def _other_split_output(value: ir.Value, expect_last: int, what: str) -> ir.Value:
    node = producer_op(value, "Split")
    need(node is not None and len(node.outputs) == 2, f"{what} is not one output of a 2-way Split", value)
    assert node is not None
    need(int_attr(node, "axis", 0) in (-1, len(value.shape or ()) - 1), f"{what}: Split not on last axis", node)
    other = node.outputs[1] if node.outputs[0] is value else node.outputs[0]
    sizes = split_sizes(node)
    if sizes is not None:
        need(sizes[other.index()] == expect_last, f"{what}: Split sizes {sizes}, expected {expect_last}", node)
    return other


def _rope_interleaved(q_pe_raw: ir.Value) -> int | None:
    """1 if the RoPE reading ``q_pe_raw`` takes even/odd channels (GPT-J), 0 for rotate_half (NeoX)."""
    for node in consumers(q_pe_raw):
        if node.op_type == "RotaryEmbedding":
            return int_attr(node, "interleaved", 0)
        if node.op_type == "Slice" and len(node.inputs) >= 5:
            steps = const_array(node.inputs[4])
            if steps is not None and int(steps.reshape(-1)[0]) == 2:
                return 1
    if any(n.op_type in ("Slice", "Mul") for n in consumers(q_pe_raw)):
        return 0
    return None


def _o_proj(attn_out: ir.Value, width: int) -> ir.Node | None:
    """MatMul(Reshape(Transpose(attn_out, [0,2,1,3]), [B,S,H*V]), Wo) with constant Wo, or None.

    SDPA exports put a shape-preserving 4D Reshape before the Transpose; it is allowed when its output rank is 4.
    """
    value = attn_out
    for _ in range(3):
        users = consumers(value)
        if len(users) != 1:
            return None
        node = users[0]
        if node.op_type == "Reshape" and node.outputs[0].shape is not None and len(node.outputs[0].shape) == 4:
            if static_dim(node.outputs[0], -1) not in (None, static_dim(value, -1)):
                return None
            value = node.outputs[0]
            continue
        if node.op_type != "Transpose" or ints_attr(node, "perm") != [0, 2, 1, 3]:
            return None
        for r in consumers(node.outputs[0], "Reshape"):
            for mm in consumers(r.outputs[0], "MatMul"):
                w = const_array(mm.inputs[1])
                if mm.inputs[0] is r.outputs[0] and w is not None and w.ndim == 2 and w.shape[0] == width:
                    return mm
        return None
    return None


def _q_proj(q_nope: ir.Value, heads: int, width: int) -> ir.Node | None:
    """MatMul(x, Wq) -> Reshape -> Transpose(0,2,1,3) -> Split producing q_nope, with constant Wq, or None."""
    split = producer_op(q_nope, "Split")
    t = producer_op(split.inputs[0], "Transpose") if split else None
    if t is None or ints_attr(t, "perm") != [0, 2, 1, 3]:
        return None
    r = producer_op(t.inputs[0], "Reshape")
    mm = producer_op(r.inputs[0], "MatMul") if r else None
    w = const_array(mm.inputs[1]) if mm else None
    if mm is None or w is None or w.ndim != 2 or w.shape[1] != heads * width:
        return None
    return mm


def match_mla_layer(graph: ir.Graph, layer: int) -> MlaLayer | LayerFailure:
    """Match the dense MLA attention of ``layer``; never mutates the graph."""
    return match_or_failure(_match, graph, layer)


def _cached_parts(past_k: ir.Value, past_v: ir.Value, heads: int | None) -> CachedParts:
    """One key head: the latent cache, else (a one-head model's expanded cache) the expanded form; more: expanded.
    A refusal gives the reason of the form the cache's head count points to."""
    if heads != 1:
        return expanded_cache(past_k, past_v)
    try:
        return latent_cache(past_k, past_v)
    except MatchFail as latent_fail:
        try:
            return expanded_cache(past_k, past_v)
        except MatchFail:
            raise latent_fail from None


def _match(graph: ir.Graph, i: int) -> MlaLayer:
    past_k, past_v = cache_inputs(graph, i)
    heads = static_dim(past_k, 1)
    need(heads is not None, f"key cache has {past_k.shape} heads, expected a static count (MLA)", past_k)
    c = _cached_parts(past_k, past_v, heads)
    latent, k_pe, k_nope, v, w_kv_b, P, V, R = c.latent, c.k_pe, c.k_nope, c.v, c.w_kv_b, c.P, c.V, c.R
    L, N = w_kv_b.shape
    need(N % (P + V) == 0, f"kv_b_proj width {N} is not a multiple of qk_nope + v_head = {P + V}", latent)
    H = N // (P + V)
    need(heads in (1, H), f"key cache has {heads} heads; kv_b_proj expands the latent to {H}", past_k)

    query, key, attn_out, scale, kind = _attention_core(v, P + R)
    concat = producer_op(query, "Concat")
    need(
        concat is not None and len(concat.inputs) == 2 and int_attr(concat, "axis") in (-1, 3),
        f"attention query is not Concat(q_nope, q_pe, axis=-1) but {describe_value(query)}",
        query,
    )
    assert concat is not None
    q_nope, q_pe = concat.inputs
    assert q_nope is not None and q_pe is not None
    need(
        c.present_key is None or key is c.present_key,
        f"attention key is {describe_value(key)}, not the key cache {c.present_key and c.present_key.name}",
        key,
    )
    need(_reaches(key, {id(k_nope)}), "attention key does not come from kv_b_proj's k_nope", key)
    need(_reaches(key, {id(k_pe)}), f"attention key does not contain the cached k_pe ({k_pe.name})", key)
    for value, dim, what in ((q_nope, P, "q_nope"), (q_pe, R, "q_pe")):
        got = static_dim(value, -1)
        need(got in (None, dim), f"{what} last dim {got}, expected {dim}", value)
    q_pe_raw = _other_split_output(q_nope, R, "q_nope")
    rope = _rope_interleaved(q_pe_raw)
    k_pe_raw = find_k_pe_raw(latent, k_pe, R)
    q_proj = _q_proj(q_nope, H, P + R)
    o_proj = _o_proj(attn_out, H * V)
    need((L + R) % 8 == 0, f"latent row width kv_lora_rank + qk_rope = {L + R} is not a multiple of 8", past_k)
    return MlaLayer(
        layer=i,
        num_heads=H,
        qk_nope=P,
        qk_rope=R,
        v_head=V,
        kv_lora_rank=L,
        scale=scale,
        w_kv_b=w_kv_b,
        kv_b_weight=c.kv_b_weight,
        q_nope=q_nope,
        q_pe=q_pe,
        q_pe_raw=q_pe_raw,
        latent=latent,
        k_pe=k_pe,
        k_pe_raw=k_pe_raw,
        attn_out=attn_out,
        rope_interleaved=rope,
        q_proj=q_proj,
        o_proj=o_proj,
        notes=[kind, c.form],
    )


def match_mla_layers(graph: ir.Graph) -> list[MlaLayer | LayerFailure]:
    """Match every layer that has ``past_key_values.{i}.key`` inputs, in layer order."""
    return [match_mla_layer(graph, i) for i in cache_layers(graph)]
