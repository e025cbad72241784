"""PagedAttention's Q/K prologue: per-head RMSNorm, then rotary embedding (reference §3.4(b)).

The norm runs in float32 and rounds to the activation type T; RoPE then runs in T arithmetic, every product
and sum rounded to T as the CUDA kernel's half-precision arithmetic does. Channels outside
``[rotary_offset, rotary_offset + rotary_dim)`` are copied through, with ``rotary_dim = 2 * cos.shape[1]``.
"""

from __future__ import annotations

import numpy as np

__all__ = ["apply_rotary", "rms_norm"]


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm over the last axis in float32, scaled by ``weight``, rounded back to ``x.dtype``."""
    xf = x.astype(np.float32)
    inv = 1.0 / np.sqrt(np.mean(xf * xf, axis=-1, keepdims=True) + np.float32(eps))
    return (xf * inv.astype(np.float32) * weight.astype(np.float32)).astype(x.dtype)


def apply_rotary(
    x: np.ndarray,
    cos_cache: np.ndarray,
    sin_cache: np.ndarray,
    positions: np.ndarray,
    *,
    interleaved: bool,
    rotary_offset: int = 0,
) -> np.ndarray:
    """Rotate ``x`` (``[tokens, heads, head_size]``, dtype T) at ``positions`` (``[tokens]``); returns a new array.

    Interleaved (GPT-J) pairs channels ``(2i, 2i+1)``; half-split (NeoX) pairs ``(i, i + rotary_dim/2)``.
    """
    dt = x.dtype
    half = cos_cache.shape[1]
    rd = 2 * half
    if rotary_offset + rd > x.shape[-1]:
        raise ValueError(
            f"rotary: expected rotary_offset + rotary_dim <= head_size, found {rotary_offset} + {rd} > {x.shape[-1]}"
        )
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= min(cos_cache.shape[0], sin_cache.shape[0])):
        # CUDA reads out of bounds here; an oracle must not invent a value
        raise ValueError(
            f"rotary: expected positions in [0, {min(cos_cache.shape[0], sin_cache.shape[0])}) (cos/sin rows), "
            f"found range [{pos.min()}, {pos.max()}]"
        )

    def r(v: np.ndarray) -> np.ndarray:  # one T rounding, kept in float32 for the next operation
        return v.astype(dt).astype(np.float32)

    c = cos_cache[pos].astype(np.float32)[:, None, :]
    s = sin_cache[pos].astype(np.float32)[:, None, :]
    seg = x[..., rotary_offset : rotary_offset + rd].astype(np.float32)
    if interleaved:
        a, b = seg[..., 0::2], seg[..., 1::2]
    else:
        a, b = seg[..., :half], seg[..., half:]
    ya = r(r(a * c) - r(b * s))
    yb = r(r(b * c) + r(a * s))
    out = x.copy()
    if interleaved:
        out[..., rotary_offset : rotary_offset + rd : 2] = ya.astype(dt)
        out[..., rotary_offset + 1 : rotary_offset + rd : 2] = yb.astype(dt)
    else:
        out[..., rotary_offset : rotary_offset + half] = ya.astype(dt)
        out[..., rotary_offset + half : rotary_offset + rd] = yb.astype(dt)
    return out
