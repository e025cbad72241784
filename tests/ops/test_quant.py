"""KV cache formats: quantize/dequantize within one step, int4 nibble layout, and sanitization rules."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ortpa.ops.oracle.quant import (
    cache_kind,
    channel_scale,
    dequantize,
    pack_int4,
    quantize,
    storage_dtype,
    unpack_int4,
)
from ortpa.ops.oracle.sanitize import sanitize_block_table, sanitize_lengths

QMAX = {"int8": 127.0, "float8e4m3fn": 448.0, "int4": 7.0}


def _scale(kind: str, quant_type: str, x: np.ndarray) -> np.ndarray:
    """A scale that covers ``x`` ([tokens, kvh, H]), as the op's own tests choose it (amax / qmax)."""
    if quant_type == "PER_TENSOR":
        return np.array([np.abs(x).max() / QMAX[kind]], np.float32)
    return (np.abs(x).max(axis=0, keepdims=True) / QMAX[kind]).transpose(1, 0, 2).astype(np.float32)  # [kvh,1,H]


@pytest.mark.parametrize("kind", ["int8", "float8e4m3fn", "int4"])
@pytest.mark.parametrize("quant_type", ["PER_TENSOR", "PER_CHANNEL"])
@pytest.mark.parametrize("head_size", [16, 7])
def test_round_trip_within_one_step(kind, quant_type, head_size):
    rng = np.random.default_rng(0)
    kvh = 3
    x = (rng.standard_normal((50, kvh, head_size)) * rng.uniform(0.1, 4, (1, kvh, head_size))).astype(np.float32)
    s = channel_scale(_scale(kind, quant_type, x), quant_type, kvh, head_size)
    stored = quantize(x, kind, s)
    assert stored.dtype == storage_dtype(kind)
    width = (head_size + 1) // 2 if kind == "int4" else head_size
    assert stored.shape == (50, kvh, width)
    back = dequantize(stored, kind, s, head_size)
    assert back.shape == x.shape and back.dtype == np.float32
    sb = np.broadcast_to(s, x.shape)
    if kind == "float8e4m3fn":
        # 3 mantissa bits: half a step is 2**-4 relative; subnormals (below 2**-6 * s) step 2**-9 * s
        bound = np.maximum(np.abs(x) * 2.0**-4, sb * 2.0**-10)
    else:
        bound = sb / 2
    assert np.all(np.abs(back - x) <= bound * (1 + 1e-6)), f"{kind} {quant_type}: error above half a step"


def test_int8_rounds_half_to_even_and_clamps():
    s = np.array([[1.0]], np.float32)
    x = np.array([[0.5, 1.5, 2.5, -0.5, -2.5, 300.0, -300.0, 126.6]], np.float32)
    np.testing.assert_array_equal(quantize(x, "int8", s), [[0, 2, 2, 0, -2, 127, -128, 127]])
    np.testing.assert_array_equal(quantize(x, "float8e4m3fn", s).astype(np.float32)[0, 5:7], [288.0, -288.0])
    big = np.array([[1000.0, -1000.0]], np.float32)
    np.testing.assert_array_equal(quantize(big, "float8e4m3fn", s).astype(np.float32), [[448.0, -448.0]])


def test_zero_scale_quantizes_to_zero():
    x = np.array([[1.0, -2.0, 3.0]], np.float32)
    for kind in ("int8", "float8e4m3fn", "int4"):
        q = quantize(x, kind, np.zeros((1, 3), np.float32))
        assert np.all(dequantize(q, kind, np.ones((1, 3), np.float32), 3) == 0), kind


def test_int4_layout_low_nibble_first_and_odd_padding():
    q = np.array([1, -2, 7, -8, 0], np.int8)
    packed = pack_int4(q)
    # byte i = (q[2i] + 8) | (q[2i+1] + 8) << 4; odd length pads the last high nibble with 8 (logical 0)
    np.testing.assert_array_equal(packed, [9 | (6 << 4), 15 | (0 << 4), 8 | (8 << 4)])
    np.testing.assert_array_equal(unpack_int4(packed, 5), q)


def test_int4_pack_round_trip_all_values():
    rng = np.random.default_rng(1)
    for h in (1, 2, 15, 64):
        q = rng.integers(-8, 8, size=(4, 3, h)).astype(np.int8)
        np.testing.assert_array_equal(unpack_int4(pack_int4(q), h), q)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(np.array([8]))


def test_cache_kind_names():
    assert cache_kind(np.uint8) == "int4"
    assert cache_kind(ml_dtypes.float8_e4m3fn) == "float8e4m3fn"
    assert cache_kind(ml_dtypes.bfloat16) == "bfloat16"
    with pytest.raises(TypeError, match="found float32"):
        cache_kind(np.float32)


def test_per_channel_scale_shapes():
    s = np.arange(6, dtype=np.float32)
    assert channel_scale(s.reshape(2, 1, 3), "PER_CHANNEL", 2, 3).shape == (2, 3)
    assert channel_scale(s.reshape(2, 3), "per_channel", 2, 3).shape == (2, 3)
    assert channel_scale(None, "NONE", 2, 3) is None
    with pytest.raises(ValueError, match=r"\(2, 1, 3\)"):
        channel_scale(s.reshape(3, 2), "PER_CHANNEL", 2, 3)


# --- sanitization (reference §3.4(a), including the upstream unit-test ground truth) ---------------------


def test_sanitize_ground_truth_invalid():
    r = sanitize_lengths(np.array([5, -2, 1]), np.array([-4, 100]), max_blocks_per_seq=2, block_size=16, token_count=3)
    np.testing.assert_array_equal(r.cu_q, [0, 0, 3])
    np.testing.assert_array_equal(r.past, [0, 0])
    np.testing.assert_array_equal(r.valid, [0, 0])
    np.testing.assert_array_equal(r.cu_kv, [0, 0, 0])


def test_sanitize_ground_truth_valid_full():
    r = sanitize_lengths(np.array([0, 1]), np.array([31]), max_blocks_per_seq=2, block_size=16, token_count=1)
    np.testing.assert_array_equal(r.cu_q, [0, 1])
    np.testing.assert_array_equal(r.past, [31])
    np.testing.assert_array_equal(r.valid, [1])
    np.testing.assert_array_equal(r.cu_kv, [0, 32])


def test_sanitize_overflow_and_zero_token_rules():
    # q_len > capacity is valid only with past == 0 (kvlen capped); a zero-token sequence may sit at capacity
    r = sanitize_lengths(np.array([0, 40, 40, 41]), np.array([0, 32, 1]), 2, 16, 41)
    np.testing.assert_array_equal(r.valid, [1, 1, 1])
    np.testing.assert_array_equal(r.kvlen, [32, 32, 2])
    # non-decreasing repair re-attributes tokens instead of dropping them
    r = sanitize_lengths(np.array([0, 3, 1, 4]), np.array([0, 0, 0]), 2, 16, 4)
    np.testing.assert_array_equal(r.cu_q, [0, 3, 3, 4])


def test_sanitize_block_table():
    np.testing.assert_array_equal(sanitize_block_table(np.array([-2, -1, 0, 3, 4]), 4), [-1, -1, 0, 3, -1])
