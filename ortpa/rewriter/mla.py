"""Dense Multi-head Latent Attention -> ``com.microsoft::PagedAttention`` with ``kv_cache_layout="LATENT"``.

What a transformers-5.x export of a DeepSeek-V3-style attention looks like (per layer ``i``)::

    q      = [RMSNorm](x @ Wq_a) @ Wq_b  -> Reshape[B,S,H,P+R] -> Transpose -> Split([P, R]) -> q_nope, q_pe_raw
    ckv    = x @ Wkv_a -> Split([L, R]) -> latent = Reshape(RMSNorm(.)) [B,1,S,L],  k_pe_raw
    RoPE   : q_pe = rope(q_pe_raw), k_pe = rope(k_pe_raw) [B,1,S,R]
    cache  : present.i.key = Concat(past_key_values.i.key, latent), present.i.value = Concat(past..value, k_pe)
    expand : present.i.key @ Wkv_b -> Reshape -> Transpose -> Split([P, V]) -> k_nope, v   (over the WHOLE cache)
    attn   : softmax(scale * Concat(q_nope, q_pe) . Concat(k_nope, k_pe)^T + mask) @ v   (MatMul/Softmax, or ONNX
             Attention at opset 23)  -> attn_out [B,H,S,V] -> Transpose -> Reshape -> o_proj

Absorbed (vLLM / SGLang MLA): with Wkv_b split per head into W_UK [H,P,L] and W_UV [H,L,V],
``q_nope . k_nope = (q_nope @ W_UK) . latent`` and ``p @ v = (p @ latent) @ W_UV``; so one PagedAttention
LATENT node over the cached row ``[latent | k_pe]`` (head ``L+R``, one KV head, V = the leading ``L`` channels)
replaces the expansion, with the query ``[q_nope @ W_UK | q_pe]`` and ``W_UV`` applied to its output.
The softmax scale stays the dense one, ``1/sqrt(P+R)`` (times YaRN mscale², whatever the export baked in),
and is always written explicitly because ``v_head_size != head_size``.

Matching is structural, anchored on the cache I/O names (``past_key_values.{i}.key``/``.value``), because the
attention core comes in shapes the pattern language cannot express as one pattern (eager's ScatterND key
assembly, SDPA's split scale, ONNX ``Attention``); every failed check is an onnxscript ``MatchResult`` with a
reason and the value it concerns, reported per layer.

The rewrite assumes the packed-token layout that :mod:`ortpa.rewriter.paged_io` establishes: batch 1,
sequence = all new tokens of all sequences.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import Builder, const_array
from ortpa.rewriter.derived import derived_weight, recipe
from ortpa.rewriter.layer import MlaLayer, PagedAttentionInputs
from ortpa.rewriter.mla_expanded import Composite, PrefillSplit, TrackingBuilder, expanded_attention

__all__ = ["AbsorbMode", "absorbed_weights", "rewrite_mla_layer"]

AbsorbMode = Literal["auto", "fold", "matmul"]


def absorbed_weights(m: MlaLayer) -> tuple[np.ndarray, np.ndarray]:
    """(W_UK [H,P,L], W_UV [H,L,V]) from kv_b_proj's ``[L, H*(P+V)]`` ONNX weight."""
    w = m.w_kv_b.reshape(m.kv_lora_rank, m.num_heads, m.qk_nope + m.v_head)
    w_uk = np.ascontiguousarray(w[:, :, : m.qk_nope].transpose(1, 2, 0))
    w_uv = np.ascontiguousarray(w[:, :, m.qk_nope :].transpose(1, 0, 2))
    return w_uk, w_uv


def _fold_q(m: MlaLayer, mode: AbsorbMode) -> bool:
    """Fold W_UK into Wq when exact (a constant MatMul feeds q) and, for "auto", when it does not grow the work."""
    if mode == "matmul" or m.q_proj is None:
        return False
    if mode == "fold":
        return True
    d_in = m.q_proj.inputs[1].shape[0] if m.q_proj.inputs[1].shape else None
    if not isinstance(d_in, int):
        return False
    H, P, L = m.num_heads, m.qk_nope, m.kv_lora_rank
    return d_in * H * L <= d_in * H * P + H * P * L


def _fold_o(m: MlaLayer, mode: AbsorbMode) -> bool:
    if mode == "matmul" or m.o_proj is None:
        return False
    if mode == "fold":
        return True
    d_out = m.o_proj.inputs[1].shape[1] if m.o_proj.inputs[1].shape else None
    if not isinstance(d_out, int):
        return False
    H, V, L = m.num_heads, m.v_head, m.kv_lora_rank
    return H * L * d_out <= H * V * d_out + H * L * V


def rewrite_mla_layer(
    graph: ir.Graph,
    m: MlaLayer,
    key_cache: ir.Value,
    paged: PagedAttentionInputs,
    *,
    rope_in_op: bool = False,
    absorb: AbsorbMode = "auto",
    op_dtype: ir.DataType = ir.DataType.FLOAT16,
    split: PrefillSplit | None = None,
) -> ir.Value:
    """Replace the attention of ``m`` by PagedAttention LATENT; return the layer's ``key_cache_out``.

    ``op_dtype`` is the op's activation type T (float16/bfloat16); when the model computes in another type the
    query/key are cast to it and the output cast back. The dense nodes become dead and are removed by the
    caller's dead-code pass. With ``split`` (:mod:`ortpa.rewriter.mla_expanded`) the fresh sequences' rows are
    attended in the expanded form and written to the cache by the graph; the node gets the other rows only.
    """
    nodes: set[ir.Node] = set()
    b = (
        Builder(graph, f"/mla/layers.{m.layer}")
        if split is None
        else TrackingBuilder(graph, f"/mla/layers.{m.layer}", nodes)
    )

    def kept(value: ir.Value, axis: int) -> ir.Value:  # the absorbed node's rows only
        return value if split is None else b.op("Gather", [value, split.abs_rows], {"axis": axis})

    H, R, L = m.num_heads, m.qk_rope, m.kv_lora_rank
    w_uk, w_uv = absorbed_weights(m)
    model_dtype = m.q_nope.dtype or ir.DataType.FLOAT
    np_dtype = model_dtype.numpy()

    # q_lat = q_nope @ W_UK per head, [1,H,T,L]
    if _fold_q(m, absorb):
        assert m.q_proj is not None
        entry = _recipe(m, "q", m.q_proj.inputs[1], m.kv_b_weight)
        w_fold = derived_weight(entry, [const_array(m.q_proj.inputs[1]), m.w_kv_b]).astype(np_dtype)
        q_lat = b.op("MatMul", [kept(m.q_proj.inputs[0], 1), _derived(b, m, w_fold, "q_absorbed_weight", entry)])
        q_lat = b.op("Reshape", [q_lat, b.ints([0, 0, H, L])])
        q_lat = b.op("Transpose", [q_lat], {"perm": [0, 2, 1, 3]})
        m.notes.append("W_UK folded into q projection")
    else:
        uk = _derived(b, m, w_uk.astype(np_dtype), "W_UK", _recipe(m, "uk", m.kv_b_weight))
        q_lat = b.op("MatMul", [kept(m.q_nope, 2), uk])
        m.notes.append("W_UK as per-head MatMul")
    q_pe = m.q_pe_raw if rope_in_op else m.q_pe
    query = b.op("Concat", [q_lat, kept(q_pe, 2)], {"axis": -1})
    query = b.op("Transpose", [query], {"perm": [0, 2, 1, 3]})
    query = b.op("Reshape", [query, b.ints([-1, H * (L + R)])], hint="query")

    if rope_in_op:
        if m.k_pe_raw is None:
            raise ValueError(f"layer {m.layer}: k_pe before RoPE not found; cannot move RoPE into the op")
        k_pe = b.op("Reshape", [m.k_pe_raw, b.ints([-1, R])])
        latent = b.op("Reshape", [m.latent, b.ints([-1, L])])
        key = b.op("Concat", [latent, k_pe], {"axis": -1}, hint="key")
    else:
        # rows first: the latent is [B,1,S,L] where cached, [B,S,L] where the cache held expanded heads
        latent = b.op("Reshape", [m.latent, b.ints([-1, L])])
        k_pe = b.op("Reshape", [m.k_pe, b.ints([-1, R])])
        key = b.op("Concat", [latent, k_pe], {"axis": -1}, hint="key")
    if model_dtype != op_dtype:
        query = b.op("Cast", [query], {"to": op_dtype})
        key = b.op("Cast", [key], {"to": op_dtype})
    all_keys = key
    if split is not None:
        key = kept(key, 0)
    # Static widths on the op's inputs: validators and the portable lowering read head sizes from them.
    query.shape, query.type = ir.Shape(["num_tokens", H * (L + R)]), ir.TensorType(op_dtype)
    key.shape, key.type = ir.Shape(["num_tokens", L + R]), ir.TensorType(op_dtype)

    attrs: dict = {
        "num_heads": H,
        "kv_num_heads": 1,
        "kv_cache_layout": "LATENT",
        "v_head_size": L,
        "scale": float(m.scale),
    }
    cos = sin = None
    if rope_in_op:
        attrs.update(do_rotary=1, rotary_offset=L, rotary_interleaved=int(m.rope_interleaved or 0))
        cos, sin = paged.cos_cache, paged.sin_cache
    inputs: list[ir.Value | None] = [
        query,
        key,
        None,
        key_cache,
        None,
        paged.cumulative_sequence_length if split is None else split.cu_abs,
        paged.past_seqlens,
        paged.block_table,
        cos,
        sin,
    ]
    metadata = paged.attention_metadata if split is None else split.metadata
    if metadata is not None:
        inputs += [None] * 6 + [metadata]
    out, cache_out = b.op("PagedAttention", inputs, attrs, domain="com.microsoft", num_outputs=2, hint="PagedAttention")
    out.shape, out.type = ir.Shape(["num_tokens", H * L]), ir.TensorType(op_dtype)
    if model_dtype != op_dtype:
        out = b.op("Cast", [out], {"to": model_dtype})

    if split is not None:
        return _merge_expanded(b, m, split, out, cache_out, all_keys, absorb=absorb, nodes=nodes)
    if _fold_o(m, absorb):
        assert m.o_proj is not None
        proj = b.op("MatMul", [out, _w_uv_o(b, m)])
        proj = b.op("Unsqueeze", [proj, b.ints([0])], hint="o_proj")
        m.o_proj.outputs[0].replace_all_uses_with(proj)
        m.notes.append("W_UV folded into o_proj")
    else:
        o = b.op("Reshape", [out, b.ints([-1, H, L])])
        o = b.op("Transpose", [o], {"perm": [1, 0, 2]})
        uv = _derived(b, m, w_uv.astype(np_dtype), "W_UV", _recipe(m, "uv", m.kv_b_weight))
        o = b.op("MatMul", [o, uv])  # [H,T,V]
        o = b.op("Unsqueeze", [o, b.ints([0])], hint="attn_out")
        m.attn_out.replace_all_uses_with(o)
        m.notes.append("W_UV as per-head MatMul")
    return cache_out


def _w_uv_o(b: Builder, m: MlaLayer) -> ir.Value:
    """W_UV folded into o_proj: ``[H * L, D]`` in the model's dtype, as an initializer."""
    assert m.o_proj is not None
    wo = const_array(m.o_proj.inputs[1])  # [H*V, D]
    entry = _recipe(m, "o", m.kv_b_weight, m.o_proj.inputs[1])
    return _derived(b, m, derived_weight(entry, [m.w_kv_b, wo]).astype(wo.dtype), "o_absorbed_weight", entry)


def _recipe(m: MlaLayer, kind: str, *factors: ir.Value | None) -> dict:
    """The recipe of a weight computed from ``factors`` (:func:`ortpa.rewriter.derived.recipe`); its factor names
    are None where one is not an initializer of the original (a dequantized int4 ``kv_b_proj``)."""
    names = [f.name if f is not None and f.is_initializer() else None for f in factors]
    return recipe(kind, names, m.num_heads, m.qk_nope, m.qk_rope, m.kv_lora_rank, m.v_head)


def _derived(b: Builder, m: MlaLayer, array: np.ndarray, hint: str, entry: dict) -> ir.Value:
    """``array`` as an initializer, its recipe recorded (where every factor is named) for the verification's twin
    (:mod:`ortpa.rewriter.derived`)."""
    value = b.initializer(array, hint)
    if all(entry["factors"]):
        m.derived[value.name] = entry
    return value


def _merge_expanded(
    b: Builder,
    m: MlaLayer,
    split: PrefillSplit,
    out: ir.Value,
    cache_out: ir.Value,
    key: ir.Value,
    *,
    absorb: AbsorbMode,
    nodes: set[ir.Node],
) -> ir.Value:
    """The fresh rows in the expanded form, merged with the absorbed node's rows ``out``; the cache with the fresh
    rows written. Merged where both forms meet: at o_proj's output when W_UV is folded into it, else before it."""
    H, V, L = m.num_heads, m.v_head, m.kv_lora_rank
    model_dtype = m.q_nope.dtype or ir.DataType.FLOAT
    np_dtype = model_dtype.numpy()
    _, w_uv = absorbed_weights(m)
    grid = expanded_attention(
        b,
        split,
        q_nope=m.q_nope,
        q_pe=m.q_pe,
        latent=m.latent,
        k_pe=m.k_pe,
        w_kv_b=m.w_kv_b,
        num_heads=H,
        qk_nope=m.qk_nope,
        v_head=V,
        scale=m.scale,
        derived=m.derived,
        kv_b_weight=m.kv_b_weight,
    )  # float32 [S * M, H * V]
    if model_dtype != ir.DataType.FLOAT:
        grid = b.op("Cast", [grid], {"to": model_dtype})
    fold = _fold_o(m, absorb)
    if fold:
        assert m.o_proj is not None
        absorbed = b.op("MatMul", [out, _w_uv_o(b, m)])
        grid = b.op("MatMul", [grid, m.o_proj.inputs[1]])
        m.notes.append("W_UV folded into o_proj")
    else:
        o = b.op("Transpose", [b.op("Reshape", [out, b.ints([-1, H, L])])], {"perm": [1, 0, 2]})
        # a Reshape between them: ONNX Runtime fuses Transpose + MatMul into FusedMatMul, which divides by zero
        # (SIGFPE) when the absorbed rows are empty (a step of fresh prompts only)
        o = b.op("Reshape", [o, b.ints([H, -1, L])])
        uv = _derived(b, m, w_uv.astype(np_dtype), "W_UV", _recipe(m, "uv", m.kv_b_weight))
        o = b.op("MatMul", [o, uv])  # [H, T_a, V]
        absorbed = b.op("Reshape", [b.op("Transpose", [o], {"perm": [1, 0, 2]}), b.ints([-1, H * V])])
        m.notes.append("W_UV as per-head MatMul")
    merged = b.op("Gather", [b.op("Concat", [absorbed, grid], {"axis": 0}), split.merge], hint="merged")
    if fold:
        assert m.o_proj is not None
        result = b.op("Unsqueeze", [merged, b.ints([0])], hint="o_proj")
        m.o_proj.outputs[0].replace_all_uses_with(result)
        rank, axis, inputs = 3, 1, (m.q_proj.inputs[0] if _fold_q(m, absorb) and m.q_proj is not None else m.q_nope,)
    else:
        o = b.op("Transpose", [b.op("Reshape", [merged, b.ints([-1, H, V])])], {"perm": [1, 0, 2]})
        result = b.op("Unsqueeze", [o, b.ints([0])], hint="attn_out")
        m.attn_out.replace_all_uses_with(result)
        rank, axis, inputs = 4, 2, (m.q_nope,)
    m.notes.append("fresh prefill in the expanded form")
    # the fresh rows' latent + k_pe, at the slots the absorbed node would write them
    rows = b.op("Unsqueeze", [b.op("Gather", [key, split.write_rows]), b.ints([1])])
    cache = b.op("ScatterND", [cache_out, split.write_index, rows], hint="fresh_cache_write")
    data = (*inputs, m.q_nope, m.q_pe, m.latent, m.k_pe, key)
    split.composites.append(Composite(result, rank, axis, tuple(dict.fromkeys(data)), frozenset(nodes | split.nodes)))
    return cache
