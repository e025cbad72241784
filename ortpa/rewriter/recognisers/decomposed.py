"""Structural matcher for dense MHA / GQA attention layers (see :mod:`ortpa.rewriter.attention`).

Anchored on the cache I/O names ``past_key_values.{i}.key``/``.value``: from each cache ``Concat`` forward to the
attention that reads it (through repeat_kv), back from there to the query, the scores' scale / softcap / mask,
and back from q / k to RoPE and an optional per-head RMSNorm. Never mutates the graph; every failed check is an
onnxscript ``MatchResult`` with a reason and the value it concerns, reported per layer as a ``LayerFailure``.

This module holds the layer record, the per-layer checks and what blocks RoPE-in-op; the attention core (scores,
scale, softcap, mask window) is read in :mod:`ortpa.rewriter.recognisers.decomposed_core`, RoPE and the q / k RMSNorm in
:mod:`ortpa.rewriter.recognisers.decomposed_qk`.
"""

from __future__ import annotations

import math
from collections import deque

import onnx_ir as ir

from ortpa.errors import UnsupportedModel
from ortpa.rewriter._fold import fold_partial, fold_static
from ortpa.rewriter._graph import static_dim, static_width
from ortpa.rewriter.layer import AttentionLayer, LayerFailure
from ortpa.rewriter.recognisers._match import (
    cache_concat,
    cache_inputs,
    cache_layers,
    match_or_failure,
    need,
    reaches,
)
from ortpa.rewriter.recognisers.decomposed_core import attention_core, sliding_window
from ortpa.rewriter.recognisers.decomposed_qk import before_transpose_norm, rope_input
from ortpa.rewriter.recognisers.position_bias import layer_score_bias, positional_bias

__all__ = [
    "match_attention_layer",
    "match_attention_layers",
    "recognise_decomposed",
]


def _heads_from_projection(query: ir.Value, head_size: int, max_nodes: int = 40) -> int | None:
    """Query heads = width of the projection the query was reshaped from / the width of one head's row there.

    Walks back from the attention's query (through RoPE's element-wise ops and the head transpose) to the first
    ``Reshape`` whose input has a known last dimension (a MatMul weight's width when shapes are symbolic). A row
    is ``head_size`` wide, or the Reshape target's last entry when it states one: a fused QKV projection viewed
    per head as ``[B, S, H, 3 * D]`` (each head's q, k, v adjacent, split along the last axis) has ``H`` heads,
    not ``3 * H``. A ``Slice`` on the heads axis on the way (multi-query's fused ``[B, S, H + 2, D]`` cut into
    q ``[:H]``, k, v) states the query's own count: its extent.
    """
    seen: set[int] = set()
    queue = deque([query])
    cut: tuple[int, int] | None = None  # a Slice from the end of the heads axis (Falcon's q = qkv[:, :, :-2])
    while queue and len(seen) < max_nodes:
        node = queue.popleft().producer()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type == "Slice" and len(node.inputs) >= 4 and cut is None:
            starts, ends, axes = (fold_static(v) for v in node.inputs[1:4])
            if (
                starts is not None
                and ends is not None
                and axes is not None
                and axes.reshape(-1).tolist() in ([2], [-2])
            ):
                start, end = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
                if 0 <= start < end < 2**31:
                    return end - start
                cut = (start, end)  # counted from the end: the fused count is found at the Reshape below
        if node.op_type == "Reshape":
            width = static_width(node.inputs[0])
            target = fold_partial(node.inputs[1]) if len(node.inputs) > 1 else None
            row = head_size
            if target is not None and target.ndim == 1 and target.size == 4 and (target[-1] or 0) > 0:
                row = int(target[-1])
            if width is not None and width % row == 0:
                return _cut_heads(width // row, cut)
            queue.append(node.inputs[0])  # a reshape of a reshape (Falcon's [B, H, S, D] view of the cut q)
            continue
        queue.extend(v for v in node.inputs if v is not None and v.const_value is None)
    return None


def _cut_heads(heads: int, cut: tuple[int, int] | None) -> int | None:
    """The heads a Slice ``[start:end]`` keeps of ``heads`` (bounds from the end as Python counts them)."""
    if cut is None:
        return heads
    kept = len(range(heads)[slice(*cut)])
    return kept or None


def match_attention_layer(graph: ir.Graph, layer: int) -> AttentionLayer | LayerFailure:
    """Match the dense MHA / GQA attention of ``layer``; never mutates the graph."""
    return match_or_failure(_match, graph, layer)


def _alibi(layer: int, detail: str) -> UnsupportedModel:
    return UnsupportedModel(
        f"layer {layer}",
        f"its scores get a per-head positional bias (ALiBi: {detail}); PagedAttention takes no bias on the scores, "
        "so ALiBi models are not converted",
    )


def _match(graph: ir.Graph, i: int) -> AttentionLayer:
    past_k, past_v = cache_inputs(graph, i)
    if past_v.consumers():  # a position bias is said first, whatever else the layer's form would be refused for
        present = next((n.outputs[0] for n in past_v.consumers() if n.op_type == "Concat"), None)
        found = layer_score_bias(present) if present is not None else None
        if found is not None:
            raise _alibi(i, found)
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
    core = attention_core(present_v)
    need(reaches(core.key, present_k), f"attention key does not come from the key cache {present_k.name}", core.key)
    h = static_dim(core.query, 1)
    if h is None:  # TorchScript-era exports reshape with Concat(batch, seq, -1, head): heads from the projection
        h = _heads_from_projection(core.query, d)
    need(h is not None, f"query heads are not static and no projection states them: {core.query.shape}", core.query)
    assert h is not None
    need(
        static_dim(core.query, -1) in (None, d),
        f"query head size {static_dim(core.query, -1)}, cache head size {d}",
        core.query,
    )
    need(h % kvh == 0, f"{h} query heads are not a multiple of {kvh} KV heads", core.query)
    # the key may reach the scores transposed / reshaped: its heads are checked through the repeated value
    got = static_dim(core.value, 1)
    # multi-query attention may read its one value head broadcast over the query heads (no repeat_kv)
    need(got in (None, h) or got == kvh == 1, f"attention value has {got} heads, query has {h}", core.value)
    got = static_dim(core.attn_out, 1)
    need(got in (None, h), f"attention output has {got} heads, query has {h}", core.attn_out)
    for what, v in (("key", k_new), ("value", v_new)):
        need(static_dim(v, 1) in (None, kvh), f"new {what} has {static_dim(v, 1)} heads, cache has {kvh}", v)
    need(d % 8 == 0, f"head size {d} is not a multiple of 8 (PagedAttention)", past_k)
    window = sliding_window(core.masks)
    alibi = positional_bias(core.masks, h)
    if alibi is not None:
        raise _alibi(i, f"node {alibi.name!r} scales positions by per-head slopes")

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
    q_raw, k_raw = rope_input(core.query, d), rope_input(k_new, d)
    if q_raw is not None and k_raw is not None:
        m.query_raw, m.key_raw = q_raw, k_raw
        m.q_norm, m.k_norm = before_transpose_norm(q_raw), before_transpose_norm(k_raw)
    return m


recognise_decomposed = _match  # the recogniser of the decomposed / SDPA / ONNX Attention forms (raises MatchFail)


def match_attention_layers(graph: ir.Graph) -> list[AttentionLayer | LayerFailure]:
    """Match every layer that has ``past_key_values.{i}.key`` inputs, in layer order."""
    return [match_attention_layer(graph, i) for i in cache_layers(graph)]
