"""NumPy reference of ``com.microsoft::PagedAttention`` as ONNX Runtime 1.32's CUDA kernel defines it.

Every execution path of ortpa (native kernels, the portable op, converted models) is checked against this.
The steps follow reference §8: validate (:func:`ortpa.ops.validate.check_inputs`), sanitize the index inputs
(§3.4(a)), run the Q/K prologue (QK-norm in float32 rounded to T, then RoPE in T arithmetic at position
``past + i``), write K/V into copies of the caches (quantizing), then attend over what the caches now hold,
so cache rounding and quantization reach the output exactly as on the device.

Choices where backends differ or behaviour is undefined (reference §3.4(d), §10):

* an unmapped (-1) page inside the attended range is masked out, as the paged-decode, latent and Flash
  kernels do (the gather backends zero-fill it instead); whatever it would read (another sequence's block,
  NaN/Inf garbage) never reaches the output;
* two tokens of one call writing the same cache slot (a duplicate ``slot_mapping`` entry, a block table that
  repeats a block) race on CUDA; here the last writer (highest token index) wins;
* query token ``i`` of sequence ``b`` sits at position ``past[b] + i`` and keys beyond the sequence's live
  length ``min(past + q_len, capacity)`` do not exist; this only matters for the overflow case
  ``q_len > capacity``, where bottom-right-aligned backends shift the mask instead;
* a RoPE position outside the cos/sin rows (an out-of-bounds read on CUDA) raises ``ValueError``;
* LATENT with a packed int4 cache raises :class:`~ortpa.errors.NotImplementedByBackend`: the CUDA latent kernel
  reads the packed bytes as values, which defines no usable semantics.

Accumulation is float32; the output is cast to T. Python loops run over sequences only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ortpa.errors import NotImplementedByBackend
from ortpa.ops.oracle.quant import cache_kind, channel_scale, dequantize, quantize
from ortpa.ops.oracle.rope import apply_rotary, rms_norm
from ortpa.ops.oracle.sanitize import sanitize_block_table, sanitize_lengths
from ortpa.ops.params import PagedAttentionParams
from ortpa.ops.validate import check_inputs

__all__ = ["paged_attention"]

_INPUT_NAMES = (
    "query",
    "key",
    "value",
    "key_cache",
    "value_cache",
    "cumulative_sequence_length",
    "past_seqlens",
    "block_table",
    "cos_cache",
    "sin_cache",
    "slot_mapping",
    "head_sink",
    "q_norm_weight",
    "k_norm_weight",
    "k_scale",
    "v_scale",
    "attention_metadata",
)


def paged_attention(
    query,
    key,
    value,
    key_cache,
    value_cache,
    cumulative_sequence_length,
    past_seqlens,
    block_table,
    cos_cache=None,
    sin_cache=None,
    slot_mapping=None,
    head_sink=None,
    q_norm_weight=None,
    k_norm_weight=None,
    k_scale=None,
    v_scale=None,
    attention_metadata=None,
    *,
    num_heads: int,
    kv_num_heads: int,
    scale: float | None = None,
    softcap: float = 0.0,
    local_window_size: int = -1,
    do_rotary: int = 0,
    rotary_interleaved: int = 0,
    kv_cache_layout: str = "SEPARATE",
    v_head_size: int = 0,
    rotary_offset: int = 0,
    is_causal: int = 1,
    qk_norm_epsilon: float = 1e-6,
    k_quant_type: str = "NONE",
    v_quant_type: str = "NONE",
    k_cache_dtype: str = "",
    v_cache_dtype: str = "",
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Run PagedAttention; returns ``(output, key_cache_out, value_cache_out)``.

    ``output`` is ``[token_count, num_heads * v_head_size]`` in T; the cache outputs are updated copies of the
    inputs (``value_cache_out`` is ``None`` in LATENT). No input is modified.
    """
    local = locals()
    inputs = {name: local[name] for name in _INPUT_NAMES}
    attrs: dict[str, Any] = {
        "num_heads": num_heads,
        "kv_num_heads": kv_num_heads,
        "softcap": softcap,
        "local_window_size": local_window_size,
        "do_rotary": do_rotary,
        "rotary_interleaved": rotary_interleaved,
        "kv_cache_layout": kv_cache_layout,
        "v_head_size": v_head_size,
        "rotary_offset": rotary_offset,
        "is_causal": is_causal,
        "qk_norm_epsilon": qk_norm_epsilon,
        "k_quant_type": k_quant_type,
        "v_quant_type": v_quant_type,
        "k_cache_dtype": k_cache_dtype,
        "v_cache_dtype": v_cache_dtype,
    }
    if scale is not None:  # absent, not 0.0: "explicit scale required" must still fire for a missing scale
        attrs["scale"] = scale
    p = check_inputs(inputs, attrs)
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf activations are data, not an error
        return _compute(inputs, p)


def _compute(x: Mapping[str, Any], p: PagedAttentionParams) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    query = np.asarray(x["query"])
    dt = query.dtype
    n, kvh, h, vh = p.num_heads, p.kv_num_heads, int(p.head_size), int(p.v_head_size)
    tokens = query.shape[0]
    kc_out = np.array(x["key_cache"], copy=True)
    vc_out = None if p.is_latent else np.array(x["value_cache"], copy=True)
    out = np.zeros((tokens, n, vh), np.float32)
    if tokens == 0:  # the kernel returns before touching values or caches (§1.10.4)
        return out.reshape(0, n * vh).astype(dt), kc_out, vc_out

    k_kind = cache_kind(kc_out.dtype)
    if p.is_latent and k_kind == "int4":
        raise NotImplementedByBackend(
            "oracle",
            "kv_cache_layout='LATENT' with a packed int4 (uint8) cache",
            "the CUDA latent kernel reads packed bytes without nibble decoding, so the result is undefined",
        )
    k_s = channel_scale(x["k_scale"], p.k_quant_type, kvh, h)
    v_s = None if p.is_latent else channel_scale(x["v_scale"], p.v_quant_type, kvh, h)

    q, k, v = _split_qkv(query, x["key"], x["value"], p)
    bs, num_blocks, max_blocks = int(p.block_size), int(p.num_blocks), int(p.max_blocks_per_seq)
    lens = sanitize_lengths(x["cumulative_sequence_length"], x["past_seqlens"], max_blocks, bs, tokens)
    bt = sanitize_block_table(x["block_table"], num_blocks)
    # Sequence of each token by binary search on the sanitized offsets; with empty sequences (repeated offsets)
    # 'right' picks the last one, which is the sequence that owns the token.
    seq = np.searchsorted(lens.cu_q, np.arange(tokens), side="right") - 1
    pos = lens.past[seq] + (np.arange(tokens) - lens.cu_q[seq])
    live = lens.valid[seq].astype(bool)

    q, k = _prologue(q, k, x, p, pos, live)

    # cache write first: attention reads the new tokens back through the (possibly quantized) cache
    slots = _slots(x["slot_mapping"], bt, seq, pos, bs, max_blocks)
    write = _last_writers(slots, live & (slots >= 0) & (slots < num_blocks * bs))
    kc_flat = kc_out.reshape(num_blocks * bs, kvh, kc_out.shape[-1])
    kc_flat[slots[write]] = quantize(k[write], k_kind, k_s)
    if vc_out is not None:
        v_kind = cache_kind(vc_out.dtype)
        vc_flat = vc_out.reshape(num_blocks * bs, kvh, vc_out.shape[-1])
        vc_flat[slots[write]] = quantize(v[write], v_kind, v_s)

    sink = None if x["head_sink"] is None else np.asarray(x["head_sink"]).astype(np.float32)
    for b in range(lens.valid.shape[0]):
        t0, t1 = int(lens.cu_q[b]), int(lens.cu_q[b + 1])
        if not lens.valid[b] or t1 == t0 or lens.kvlen[b] == 0:
            continue  # zero rows: invalid sequence or nothing to attend
        keys, values, key_ok = _gather_sequence(kc_out, vc_out, bt[b], int(lens.kvlen[b]), p, k_kind, k_s, v_s)
        out[t0:t1] = _attend(q[t0:t1], keys, values, key_ok, pos[t0:t1], int(lens.kvlen[b]), p, sink)
    return out.reshape(tokens, n * vh).astype(dt), kc_out, vc_out


def _split_qkv(query: np.ndarray, key, value, p: PagedAttentionParams):
    """Q as ``[T, N, H]``, K and V as ``[T, kvh, H]`` (V is None in LATENT); packed rows are ``[Q | K | V]``."""
    n, kvh, h = p.num_heads, p.kv_num_heads, int(p.head_size)
    t = query.shape[0]
    if p.is_packed_qkv:
        q = query[:, : n * h]
        k = query[:, n * h : (n + kvh) * h]
        v = query[:, (n + kvh) * h : (n + 2 * kvh) * h]
    else:
        # SEPARATE tolerates q_hidden % num_heads != 0 (§1.2 quirk); the kernels use num_heads * head_size
        q, k = query[:, : n * h], np.asarray(key)
        v = None if p.is_latent else np.asarray(value)
    q = q.reshape(t, n, h)
    k = k.reshape(t, kvh, h)
    return q, k, (None if v is None else v.reshape(t, kvh, h))


def _prologue(q, k, x: Mapping[str, Any], p: PagedAttentionParams, pos: np.ndarray, live: np.ndarray):
    if p.use_qk_norm:
        q = rms_norm(q, np.asarray(x["q_norm_weight"]), p.qk_norm_epsilon)
        k = rms_norm(k, np.asarray(x["k_norm_weight"]), p.qk_norm_epsilon)
    if p.do_rotary and p.rotary_dim > 0:
        # only live tokens are rotated: an invalid sequence writes nothing and outputs zeros, so its position
        # (0 + i after sanitization) must not trip the cos/sin bounds check
        cos, sin = np.asarray(x["cos_cache"]), np.asarray(x["sin_cache"])
        kw = {"interleaved": p.rotary_interleaved, "rotary_offset": p.rotary_offset}
        q, k = q.copy(), k.copy()
        q[live] = apply_rotary(q[live], cos, sin, pos[live], **kw)
        k[live] = apply_rotary(k[live], cos, sin, pos[live], **kw)
    return q, k


def _slots(slot_mapping, bt: np.ndarray, seq: np.ndarray, pos: np.ndarray, bs: int, max_blocks: int) -> np.ndarray:
    """Flat cache slot of every token, -1 for "do not write" (§3.4(c))."""
    if slot_mapping is not None:
        return np.asarray(slot_mapping).astype(np.int64).reshape(-1)
    blk = pos // bs
    inside = blk < max_blocks
    page = np.where(inside, bt[seq, np.minimum(blk, max_blocks - 1)], -1)
    return np.where(page >= 0, page * bs + pos % bs, -1)


def _last_writers(slots: np.ndarray, write: np.ndarray) -> np.ndarray:
    """Token indices that write, keeping only the last (highest) token of each duplicated slot.

    Two tokens resolving to one slot race on CUDA; ortpa's paths make it deterministic (last writer wins).
    NumPy leaves repeated indices in an assignment unspecified, so the duplicates are removed here.
    """
    idx = np.nonzero(write)[0][::-1]
    _, first = np.unique(slots[idx], return_index=True)  # first in reversed order = last writer
    return np.sort(idx[first])


def _gather_sequence(kc, vc, bt_row: np.ndarray, kvlen: int, p: PagedAttentionParams, k_kind, k_s, v_s):
    """Dequantized K ``[kvh, kvlen, H]`` and V ``[kvh, kvlen, vh]`` of one sequence, and which keys are mapped."""
    bs, h, vh = int(p.block_size), int(p.head_size), int(p.v_head_size)
    pages = bt_row[: -(-kvlen // bs)]
    mapped = pages >= 0
    idx = np.where(mapped, pages, 0)
    key_ok = np.repeat(mapped, bs)[:kvlen]

    def read(cache, kind, s, width):
        raw = cache[idx].reshape(-1, *cache.shape[2:])[:kvlen]  # [kvlen, kvh, Hc]
        return dequantize(raw, kind, s, h)[..., :width].transpose(1, 0, 2)

    # an unmapped page reads block 0, which may belong to another sequence or hold garbage: zero it, or its
    # NaN/Inf would reach this sequence's output through 0 * NaN in the probability-weighted sum
    keys = np.where(key_ok[None, :, None], read(kc, k_kind, k_s, h), np.float32(0))
    if p.is_latent:
        values = keys[..., :vh]  # V is the leading v_head_size channels of the same dequantized row
    else:
        values = np.where(key_ok[None, :, None], read(vc, cache_kind(vc.dtype), v_s, vh), np.float32(0))
    return keys, values, key_ok


def _attend(q, keys, values, key_ok, qpos, kvlen: int, p: PagedAttentionParams, sink) -> np.ndarray:
    """Masked softmax attention of one sequence's queries ``[q_len, N, H]``; returns float32 ``[q_len, N, vh]``."""
    q_len, n, h = q.shape
    kvh = keys.shape[0]
    g = n // kvh
    # [kvh, g*q_len, H] so that query head kv*g + j meets kv head kv in one batched matmul
    qf = q.astype(np.float32).reshape(q_len, kvh, g, h).transpose(1, 2, 0, 3).reshape(kvh, g * q_len, h)
    logits = np.matmul(qf, keys.transpose(0, 2, 1)) * np.float32(p.scale)
    if p.softcap > 0:
        c = np.float32(p.softcap)
        logits = c * np.tanh(logits / c)
    logits = logits.reshape(kvh, g, q_len, kvlen)

    j = np.arange(kvlen)[None, :]
    end = (qpos + 1)[:, None] if p.is_causal else kvlen  # non-causal: to the sequence end, window still at qpos
    allowed = (j < end) & key_ok[None, :]
    if p.local_window_size > 0:
        allowed = allowed & (j > (qpos - p.local_window_size)[:, None])  # W keys including the query's own position
    logits = np.where(allowed, logits, -np.inf)

    m = logits.max(axis=-1, keepdims=True)
    if sink is not None:
        m = np.maximum(m, sink.reshape(kvh, g, 1, 1))
    m = np.where(np.isfinite(m), m, 0.0)  # fully masked row without a sink
    e = np.exp(logits - m)
    den = e.sum(axis=-1, keepdims=True)
    if sink is not None:
        den = den + np.exp(sink.reshape(kvh, g, 1, 1) - m)
    probs = e / np.where(den > 0, den, 1.0)  # empty key range: zero numerator, so a zero row, never NaN
    o = np.matmul(probs.reshape(kvh, g * q_len, kvlen), values)  # [kvh, g*q_len, vh]
    return o.reshape(kvh, g, q_len, -1).transpose(2, 0, 1, 3).reshape(q_len, n, -1)
