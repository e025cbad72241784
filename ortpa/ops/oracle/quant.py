"""KV cache element formats of PagedAttention: quantize, dequantize, and int4 nibble packing.

Quantization is symmetric with no zero point (reference §3.4(c)): ``q = Q(clamp(x / s))`` and ``x = q * s``,
all in float32. A scale of zero quantizes to zero instead of dividing by zero, as the CUDA kernel does.
Packed int4 stores two signed nibbles per byte, logical element ``2*i`` in the low nibble of byte ``i``, each
nibble biased by 8; an odd head size pads the last high nibble with 8 (logical zero).

Shared by the oracle, the portable op and the runtime, so it knows nothing about sequences or blocks.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from ortpa.dtypes import numpy_dtype

__all__ = [
    "CACHE_KINDS",
    "CacheKind",
    "cache_kind",
    "channel_scale",
    "dequantize",
    "is_quantized",
    "pack_int4",
    "quantize",
    "storage_dtype",
    "unpack_int4",
]

CacheKind = Literal["float16", "bfloat16", "int8", "float8e4m3fn", "int4"]

# Storage element type of each logical cache kind (ortpa.dtypes' names); int4 travels packed in uint8.
CACHE_KINDS: dict[str, np.dtype] = {
    **{kind: numpy_dtype(kind) for kind in ("float16", "bfloat16", "int8", "float8e4m3fn")},
    "int4": np.dtype(np.uint8),
}

# Clamp range of each quantized kind, applied to x / s before rounding.
_QRANGE: dict[str, tuple[float, float]] = {
    "int8": (-128.0, 127.0),
    "float8e4m3fn": (-448.0, 448.0),
    "int4": (-8.0, 7.0),
}


def cache_kind(dtype: np.dtype | type) -> CacheKind:
    """The logical cache kind stored in a tensor of ``dtype`` (uint8 means packed int4, as in ONNX Runtime)."""
    dt = np.dtype(dtype)
    for kind, storage in CACHE_KINDS.items():
        if storage == dt:
            return kind  # type: ignore[return-value]
    raise TypeError(
        f"KV cache element type: expected one of {sorted(str(d) for d in CACHE_KINDS.values())}, found {dt}"
    )


def storage_dtype(kind: str) -> np.dtype:
    try:
        return CACHE_KINDS[kind]
    except KeyError:
        raise ValueError(f"cache kind: expected one of {sorted(CACHE_KINDS)}, found {kind!r}") from None


def is_quantized(kind: str) -> bool:
    return kind in _QRANGE


def channel_scale(scale: np.ndarray | None, quant_type: str, kv_heads: int, head_size: int) -> np.ndarray | None:
    """The dequantization scale as float32 broadcastable against ``[..., kv_heads, head_size]``.

    PER_TENSOR takes element 0; PER_CHANNEL accepts any shape with ``kv_heads * head_size`` elements whose last
    dimension is ``head_size`` (the validator's rule, §1.8), read as ``[kv_heads, head_size]``. ``None`` for NONE.
    """
    qt = quant_type.upper()
    if qt == "NONE":
        return None
    if scale is None:
        raise ValueError(f"quantization scale: expected an array for {qt}, found None")
    s = np.asarray(scale, dtype=np.float32)
    if qt == "PER_TENSOR":
        if s.size != 1:
            raise ValueError(f"PER_TENSOR scale: expected 1 element, found shape {s.shape}")
        return s.reshape(1, 1)
    if qt == "PER_CHANNEL":
        if s.size != kv_heads * head_size or s.shape[-1:] != (head_size,):
            raise ValueError(
                f"PER_CHANNEL scale: expected shape (kv_heads, 1, head_size) = ({kv_heads}, 1, {head_size}), "
                f"found {s.shape}"
            )
        return s.reshape(kv_heads, head_size)
    raise ValueError(f"quantization type: expected NONE, PER_TENSOR or PER_CHANNEL, found {quant_type!r}")


def pack_int4(q: np.ndarray) -> np.ndarray:
    """Pack signed int4 values (any integer dtype, in [-8, 7]) along the last axis into uint8 bytes."""
    q = np.asarray(q)
    if q.size and (q.min() < -8 or q.max() > 7):
        raise ValueError(f"int4 values: expected all in [-8, 7], found range [{q.min()}, {q.max()}]")
    nib = (q.astype(np.int16) + 8).astype(np.uint8)
    if nib.shape[-1] % 2:
        # odd head size: the missing high nibble encodes logical 0
        nib = np.concatenate([nib, np.full((*nib.shape[:-1], 1), 8, np.uint8)], axis=-1)
    return (nib[..., 0::2] | (nib[..., 1::2] << 4)).astype(np.uint8)


def unpack_int4(packed: np.ndarray, head_size: int) -> np.ndarray:
    """Unpack uint8 bytes into ``head_size`` signed int4 values (int8) along the last axis."""
    packed = np.asarray(packed, dtype=np.uint8)
    if packed.shape[-1] != (head_size + 1) // 2:
        raise ValueError(
            f"packed int4: expected last dimension (head_size + 1) // 2 = {(head_size + 1) // 2}, "
            f"found {packed.shape[-1]}"
        )
    out = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), np.int8)
    out[..., 0::2] = (packed & 15).astype(np.int8) - 8
    out[..., 1::2] = (packed >> 4).astype(np.int8) - 8
    return out[..., :head_size]


def quantize(x: np.ndarray, kind: str, scale: np.ndarray | None = None) -> np.ndarray:
    """Encode activations ``x`` (``[..., head_size]``, any float dtype) as cache elements of ``kind``.

    Float kinds are a plain cast; quantized kinds need ``scale`` from :func:`channel_scale`.
    """
    dt = storage_dtype(kind)
    if not is_quantized(kind):
        return np.asarray(x).astype(dt)
    if scale is None:
        raise ValueError(f"quantize to {kind}: expected a scale, found None")
    xf = np.asarray(x, dtype=np.float32)
    s = np.broadcast_to(np.asarray(scale, np.float32), xf.shape)
    # s == 0 quantizes to 0 (kernel rule) instead of producing inf/nan
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(s != 0, xf / np.where(s != 0, s, 1.0), 0.0).astype(np.float32)
    lo, hi = _QRANGE[kind]
    r = np.clip(r, lo, hi)
    if kind == "float8e4m3fn":
        return r.astype(dt)  # ml_dtypes rounds to nearest even
    q = np.rint(r).astype(np.int8)  # rint is round-half-even
    return pack_int4(q) if kind == "int4" else q


def dequantize(
    stored: np.ndarray, kind: str, scale: np.ndarray | None = None, head_size: int | None = None
) -> np.ndarray:
    """Decode cache elements of ``kind`` to float32 (``head_size`` is needed to unpack int4)."""
    if not is_quantized(kind):
        return np.asarray(stored).astype(np.float32)
    if scale is None:
        raise ValueError(f"dequantize {kind}: expected a scale, found None")
    if kind == "int4":
        if head_size is None:
            raise ValueError("dequantize int4: expected head_size, found None")
        stored = unpack_int4(stored, head_size)
    return np.asarray(stored).astype(np.float32) * np.asarray(scale, np.float32)
