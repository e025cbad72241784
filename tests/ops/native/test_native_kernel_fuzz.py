"""Hostile index inputs through the native kernel: an error or the oracle's result, never a crash.

Two generators: test_malformed_inputs' clean-then-corrupted batches (negative / too large past lengths,
block ids outside [-1, num_blocks), holes, broken cumulative lengths, duplicate and out-of-range slots,
NaN/Inf rows and garbage blocks), compared with the oracle like the portable op is; and raw garbage, where
any int32 may sit in any index input and the index shapes may disagree with each other, compared with the
oracle's verdict (same error rule, or the same output and caches). With NaN/Inf data the kernel may give a
number where the oracle gives NaN (see compare), never the reverse. The sanitizer build
(test_native_kernel_sanitizers.py) runs hostile calls under AddressSanitizer; here the plain build must
agree with the oracle.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from ops.test_malformed_inputs import DTYPES, GENERATED_LAYOUTS, cases
from support.tolerances import assert_close

from ortpa.errors import InvalidArgument
from ortpa.ops.native.kernel.binding import INPUT_NAMES
from ortpa.ops.oracle import paged_attention

_I32 = st.integers(-(2**31), 2**31 - 1)


def same_caches(got: np.ndarray, exp: np.ndarray, name: str) -> None:
    """Byte-equal, except that two NaNs are equal whatever their payload (NumPy and C++ pick different ones)."""
    g, e = got.astype(np.float32), exp.astype(np.float32)
    both_nan = np.isnan(g) & np.isnan(e)
    width = got.dtype.itemsize
    gb = got.view(np.uint8).reshape(*got.shape, width)
    eb = exp.view(np.uint8).reshape(*exp.shape, width)
    differ = (gb != eb).any(axis=-1) & ~both_nan
    assert not differ.any(), f"{name}: {int(differ.sum())} elements differ"


def compare(kernel, x: dict, attrs: dict, dtype) -> None:
    full = {name: x.get(name) for name in INPUT_NAMES}
    try:
        exp_out, exp_k, exp_v = paged_attention(**full, **attrs)
        expected = None
    except InvalidArgument as e:
        expected = e.rule
    except ValueError as e:  # the oracle's RoPE position bound (a read out of bounds on CUDA)
        expected = f"value: {e}"
    mine = {k: None if v is None else np.array(v, copy=True) for k, v in full.items()}
    try:
        out = kernel.run(mine, attrs, threads=2)
    except InvalidArgument as e:
        if expected is not None and expected.startswith("value: rotary"):
            assert e.rule == "native.rotary_position", e
            return
        assert e.rule == expected, (e, expected)
        event(f"refused: {e.rule}")
        return
    event("ran")
    assert expected is None, f"the oracle refused ({expected}), the kernel ran"
    got, exp = out.astype(np.float32), exp_out.astype(np.float32)
    # NaN where the oracle has none is a bug; the converse is allowed: the oracle's dense probs @ values lets a
    # masked key's NaN value in through 0 * NaN, the kernel never reads a masked key
    assert not (np.isnan(got) & ~np.isnan(exp)).any(), "NaN where the oracle has a number"
    keep = ~np.isnan(exp)
    assert_close(got[keep], exp[keep], dtype, what="output")
    same_caches(mine["key_cache"], exp_k, "key_cache")
    if exp_v is not None:
        same_caches(mine["value_cache"], exp_v, "value_cache")


@pytest.mark.parametrize("layout", GENERATED_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_corrupted_batches_match_oracle(kernel, dtype, layout: str, data) -> None:
    _, bad = data.draw(cases(dtype, layout))
    compare(kernel, bad.inputs, bad.sig.attrs(), dtype)


@st.composite
def garbage(draw):
    """Small shapes, any int32 in the index inputs, index shapes that may disagree."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    n = draw(st.sampled_from([4, 8]))  # 8 over 2 KV heads: groups of four, the AVX2 path's 16-bit loops
    kvh, h, bs = 2, 16, 16
    tokens = draw(st.integers(0, 6))
    batch = draw(st.integers(1, 4))
    num_blocks = draw(st.integers(0, 5))

    def mostly(right: int, wrong) -> int:  # a wrong index shape in one draw of ten
        return right if draw(st.integers(0, 9)) else draw(wrong)

    max_blocks = mostly(draw(st.integers(1, 4)), st.just(0))
    dt = np.float16
    x = {
        "query": rng.standard_normal((tokens, n * h)).astype(dt),
        "key": rng.standard_normal((tokens, kvh * h)).astype(dt),
        "value": rng.standard_normal((tokens, kvh * h)).astype(dt),
        "key_cache": rng.standard_normal((num_blocks, bs, kvh, h)).astype(dt),
        "value_cache": rng.standard_normal((num_blocks, bs, kvh, h)).astype(dt),
    }
    small = st.integers(-3, 70)
    pick = st.one_of(small, _I32)

    def ints(count):
        return np.array(draw(st.lists(pick, min_size=count, max_size=count)), np.int32)

    cu_len = mostly(batch + 1, st.integers(0, 6))
    past_len = mostly(batch, st.integers(0, 6))
    x["cumulative_sequence_length"] = ints(cu_len)
    x["past_seqlens"] = ints(past_len)
    bt_rows = mostly(batch, st.integers(0, 5))
    x["block_table"] = ints(bt_rows * max_blocks).reshape(bt_rows, max_blocks)
    if draw(st.booleans()):
        sm_len = mostly(tokens, st.integers(0, 7))
        x["slot_mapping"] = ints(sm_len)
    attrs = {"num_heads": n, "kv_num_heads": kvh}
    if draw(st.booleans()):
        rows = draw(st.integers(0, 80))
        ang = rng.uniform(0, 6.3, (rows, 8))
        x["cos_cache"], x["sin_cache"] = np.cos(ang).astype(dt), np.sin(ang).astype(dt)
        attrs.update(do_rotary=1)
    if draw(st.booleans()):
        attrs["local_window_size"] = draw(st.integers(-2, 40))
    if draw(st.booleans()):
        attrs["is_causal"] = draw(st.integers(-1, 2))
    return x, attrs


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=garbage())
def test_garbage_indices_error_or_oracle(kernel, case) -> None:
    x, attrs = case
    compare(kernel, x, attrs, np.dtype(np.float16))
