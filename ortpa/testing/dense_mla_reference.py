"""Float64 NumPy forward of :mod:`ortpa.testing.dense_mla`'s model, written from the formulas, not the graph.

It checks the ONNX builder independently of ONNX Runtime and of the converter: the same weights, HF's
DeepSeek-V3 semantics (RMSNorm, q LoRA, latent KV, RoPE on the rope channels only, per-head expansion of the
whole latent cache by ``kv_b_proj``, causal + padding mask, SwiGLU MLP).
"""

from __future__ import annotations

import numpy as np

from ortpa.testing.dense_mla import DenseMlaConfig, DenseMlaWeights, inv_freq

__all__ = ["dense_mla_reference"]


def _np_rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return weight * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _np_rope(x: np.ndarray, positions: np.ndarray, c: DenseMlaConfig) -> np.ndarray:
    """x [B,h,S,R], positions [B,S]; the rotation HF applies (interleaved pairs in, halves out; or rotate_half)."""
    angles = positions[:, None, :, None].astype(np.float64) * inv_freq(c).astype(np.float64)  # [B,1,S,R/2]
    cos, sin = np.cos(angles), np.sin(angles)
    if c.rope_interleave:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        a, b = x[..., : c.qk_rope // 2], x[..., c.qk_rope // 2 :]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def dense_mla_reference(
    weights: DenseMlaWeights,
    config: DenseMlaConfig,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    position_ids: np.ndarray,
    past: list[tuple[np.ndarray, np.ndarray]] | None = None,
) -> tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]:
    """The model's forward in float64: ``(logits [B,S,vocab], [(present_key, present_value), ...])`` as float32.

    Same inputs as the ONNX model (``past`` defaults to empty caches). Attention is the plain per-head MHA over
    the expanded cache (``kv_b_proj`` applied to every cached latent), masked by ``attention_mask`` and
    causality in cache positions; a query row with no visible key attends uniformly (the graph's -FLT_MAX
    mask does the same), which only happens on padding rows.
    """
    c, w = config, weights
    H, P, R, V, L = c.heads, c.qk_nope, c.qk_rope, c.v_head, c.kv_lora_rank
    ids = np.asarray(input_ids, dtype=np.int64)
    B, S = ids.shape
    if past is None:
        past = [(np.zeros((B, 1, 0, L), np.float32), np.zeros((B, 1, 0, R), np.float32))] * c.layers
    p_len = past[0][0].shape[2]
    T = p_len + S
    allowed = (np.arange(T)[None, :] <= (np.arange(S) + p_len)[:, None])[None, None] & (
        np.asarray(attention_mask)[:, None, None, :] != 0
    )  # [B,1,S,T]
    x = w.embed[ids].astype(np.float64)
    presents = []
    for lw, (pk, pv) in zip(w.layers, past, strict=True):
        h = _np_rms(x, lw.input_norm, c.rms_eps)
        q = _np_rms(h @ lw.q_a, lw.q_a_norm, c.rms_eps) @ lw.q_b if lw.q_a is not None else h @ lw.q_b
        q = q.reshape(B, S, H, P + R).transpose(0, 2, 1, 3)
        q_nope, q_pe = q[..., :P], _np_rope(q[..., P:], position_ids, c)
        ckv = h @ lw.kv_a
        latent = _np_rms(ckv[..., :L], lw.kv_a_norm, c.rms_eps)[:, None]  # [B,1,S,L]
        k_pe = _np_rope(ckv[..., L:][:, None], position_ids, c)  # [B,1,S,R]
        key_cache = np.concatenate([pk.astype(np.float64), latent], axis=2)
        pe_cache = np.concatenate([pv.astype(np.float64), k_pe], axis=2)
        presents.append((key_cache.astype(np.float32), pe_cache.astype(np.float32)))
        kv = (key_cache[:, 0] @ lw.kv_b).reshape(B, T, H, P + V).transpose(0, 2, 1, 3)
        k_nope, v = kv[..., :P], kv[..., P:]
        scores = (q_nope @ k_nope.transpose(0, 1, 3, 2) + q_pe @ pe_cache.transpose(0, 1, 3, 2)) * c.scale
        scores = np.where(allowed, scores, -np.inf)
        scores = np.where(allowed.any(-1, keepdims=True), scores, 0.0)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(0, 2, 1, 3).reshape(B, S, H * V)
        x = x + attn @ lw.o
        h = _np_rms(x, lw.post_norm, c.rms_eps)
        gate = h @ lw.gate
        x = x + (gate / (1.0 + np.exp(-gate)) * (h @ lw.up)) @ lw.down
    logits = _np_rms(x, w.norm, c.rms_eps) @ w.lm_head
    return logits.astype(np.float32), presents
