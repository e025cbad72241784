"""The native CPU kernel (ortpa/ops/native/kernel) against the NumPy oracle, called directly through ctypes.

The case lists are the ones the portable op is held to (tests/ops/test_portable.py's MATRIX and make_case),
plus the quantized cache kinds the portable op lacks (float8 e4m3fn, packed int4); the accept/reject matrix
of the validator (tests/ops/validate_cases.py) checks the kernel's own validation. Outputs are compared with
the suite's tolerances, caches bit for bit (the kernel quantizes and rounds as the oracle does); the caches
are the caller's own arrays, updated in place.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from ops.test_oracle import MODES, Case, naive_attention
from ops.test_portable import MATRIX, make_case
from ops.validate_cases import ACCEPT, REJECT, build
from support.tolerances import assert_close

from ortpa.errors import InvalidArgument, NotImplementedByBackend
from ortpa.ops.backends import check_backend
from ortpa.ops.native.kernel.binding import INPUT_NAMES
from ortpa.ops.oracle import paged_attention
from ortpa.ops.validate import TensorInfo, check_inputs

BF16 = np.dtype(ml_dtypes.bfloat16)
FP8 = np.dtype(ml_dtypes.float8_e4m3fn)
DTYPES = [np.dtype(np.float16), BF16]


def full_inputs(x: dict) -> dict:
    return {name: x.get(name) for name in INPUT_NAMES}


def run_both(kernel, x: dict, attrs: dict, *, threads: int = 1):
    """(oracle output, oracle caches, kernel output, kernel caches); the kernel writes copies of the caches."""
    full = full_inputs(x)
    exp_out, exp_k, exp_v = paged_attention(**full, **attrs)
    mine = {k: (None if v is None else np.array(v, copy=True)) for k, v in full.items()}
    out = kernel.run(mine, attrs, threads=threads)
    return exp_out, exp_k, exp_v, out, mine["key_cache"], mine["value_cache"]


def assert_matches_oracle(kernel, x: dict, attrs: dict, dtype, *, exact_cache: bool = True, threads: int = 1):
    # the backend entry declares what runs here: a feature it lacks would raise before the comparison
    check_backend(check_inputs(full_inputs(x), attrs), None, "native-cpu")
    exp_out, exp_k, exp_v, out, kc, vc = run_both(kernel, x, attrs, threads=threads)
    assert out.dtype == exp_out.dtype and out.shape == exp_out.shape
    assert_close(out, exp_out, dtype, what="output")
    for name, got, exp in (("key_cache", kc, exp_k), ("value_cache", vc, exp_v)):
        if exp is None:
            assert got is None
        elif exact_cache:
            np.testing.assert_array_equal(got.view(np.uint8), exp.view(np.uint8), err_msg=name)
        else:
            assert_close(got, exp, dtype, what=name)
    return out


# ------------------------------------------------------------------------------------------------ matrix
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(MATRIX))
def test_matrix(kernel, name: str, dtype) -> None:
    rng = np.random.default_rng(sum(map(ord, name)))
    case = make_case(rng, dtype, **MATRIX[name])
    assert_matches_oracle(kernel, case.inputs, case.attrs, dtype, exact_cache=case.exact_cache)


def requantize(case, kind: str) -> None:
    """Turn an int8 case of make_case into a float8 e4m3fn or packed int4 one (same scales' shapes)."""
    x, a = case.inputs, case.attrs
    rng = np.random.default_rng(99)
    names = (("key_cache", "k_scale", "k_cache_dtype"), ("value_cache", "v_scale", "v_cache_dtype"))
    for cache, scale, dt_attr in names:
        if cache not in x:
            continue
        c = x[cache]
        if kind == "float8e4m3fn":
            x[cache] = (rng.standard_normal(c.shape) * 60).astype(FP8)
        else:
            n, bs, kvh, h = c.shape
            x[cache] = rng.integers(0, 256, (n, bs, kvh, (h + 1) // 2), dtype=np.uint8)
            x[scale] = (x[scale] * (127 / 7)).astype(np.float32)  # int4's step: the same activations span [-8, 7]
        a[dt_attr] = kind


QUANT = {
    "per_tensor": dict(quant=("int8", "PER_TENSOR", "PER_TENSOR")),
    "per_channel_mixed_rope": dict(quant=("int8", "PER_CHANNEL", "PER_TENSOR"), rotary=(32, True, 0)),
    "gqa_decode": dict(
        quant=("int8", "PER_CHANNEL", "PER_CHANNEL"), num_heads=8, kv_num_heads=2, q_lens=(1, 1, 1), pasts=(40, 3, 77)
    ),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("kind", ["int8", "float8e4m3fn", "int4"])
@pytest.mark.parametrize("name", sorted(QUANT))
def test_quantized_caches(kernel, name: str, kind: str, dtype) -> None:
    rng = np.random.default_rng(sum(map(ord, name + kind)))
    case = make_case(rng, dtype, **QUANT[name])
    if kind != "int8":
        requantize(case, kind)
    assert_matches_oracle(kernel, case.inputs, case.attrs, dtype)


@pytest.mark.parametrize("kind", ["int8", "float8e4m3fn"])
def test_latent_quantized(kernel, kind: str) -> None:
    rng = np.random.default_rng(5)
    case = make_case(
        rng, BF16, latent=True, num_heads=4, kv_num_heads=1, head_size=64, v_head_size=48,
        quant=("int8", "PER_CHANNEL", ""), rotary=(16, False, 48), q_lens=(3, 1), pasts=(0, 40),
    )  # fmt: skip
    if kind != "int8":
        requantize(case, kind)
    assert_matches_oracle(kernel, case.inputs, case.attrs, BF16)


def test_latent_int4_refused_like_the_oracle(kernel) -> None:
    rng = np.random.default_rng(6)
    case = make_case(rng, np.float16, latent=True, num_heads=2, kv_num_heads=1, head_size=32,
                     quant=("int8", "PER_TENSOR", ""))  # fmt: skip
    requantize(case, "int4")
    with pytest.raises(NotImplementedByBackend):
        paged_attention(**full_inputs(case.inputs), **case.attrs)
    with pytest.raises(NotImplementedByBackend):  # the backend entry says so before any session
        check_backend(check_inputs(full_inputs(case.inputs), case.attrs), None, "native-cpu")
    kc = case.inputs["key_cache"].copy()
    with pytest.raises(NotImplementedByBackend, match="int4"):
        kernel.run(case.inputs, case.attrs)
    np.testing.assert_array_equal(case.inputs["key_cache"], kc)  # refused before any write


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_deepseek_like_latent(kernel, dtype) -> None:
    rng = np.random.default_rng(576)
    case = make_case(
        rng, dtype, latent=True, num_heads=4, kv_num_heads=1, head_size=576, v_head_size=512,
        rotary=(64, False, 512), scale=float(192**-0.5), q_lens=(7, 1), pasts=(0, 40),
    )  # fmt: skip
    assert_matches_oracle(kernel, case.inputs, case.attrs, dtype)


def test_cache_of_another_float_type(kernel) -> None:
    """bfloat16 activations over a float16 cache: the validator binds T and T_CACHE separately, so it is valid."""
    rng = np.random.default_rng(8)
    case = make_case(rng, BF16, q_lens=(3, 1), pasts=(0, 20))
    for name in ("key_cache", "value_cache"):
        case.inputs[name] = case.inputs[name].astype(np.float16)
    assert_matches_oracle(kernel, case.inputs, case.attrs, BF16)


@pytest.mark.parametrize("mode", list(MODES))
def test_float32_activations_match_naive_attention(kernel, mode: str) -> None:
    """float32 activations and cache (ortpa's extension; ONNX Runtime's T is float16/bfloat16, so the oracle
    refuses them): against test_oracle's float64 naive attention, at float32's tolerance."""
    cfg = MODES[mode]
    c = Case(np.dtype(np.float32), past=[0, 16, 30], qlen=[5, 1, 4], kvh=cfg["kvh"], seed=1)
    attrs = {"num_heads": c.n, "kv_num_heads": c.kvh, **cfg["attrs"]}
    x = dict(zip(INPUT_NAMES, c.args(), strict=False))
    kc, vc = x["key_cache"].copy(), x["value_cache"].copy()
    x["key_cache"], x["value_cache"] = kc, vc
    out = kernel.run(x, attrs)
    scale = cfg["attrs"].get("scale", 1 / math.sqrt(c.h))
    for b in range(3):
        k, v = c.dense(b)
        ref = naive_attention(
            c.qs(b), k, v, c.past[b], scale=scale, causal=cfg["attrs"].get("is_causal", 1) == 1,
            window=cfg["attrs"].get("local_window_size", -1), softcap=cfg["attrs"].get("softcap", 0.0),
        )  # fmt: skip
        assert_close(out[c.seq(b)], ref.reshape(-1, c.n * c.h), np.float32, what=f"{mode} sequence {b}")
        for i in range(c.qlen[b]):
            p = c.past[b] + i
            blk, off = c.block_table[b, p // c.bs], p % c.bs
            np.testing.assert_array_equal(kc[blk, off], c.key[c.seq(b)][i].reshape(c.kvh, c.h))


# ------------------------------------------------------------------------------------------------ in place
def test_cache_updated_in_place(kernel) -> None:
    """The caller's cache arrays are the ones written (no copy): their new rows are the new keys/values."""
    rng = np.random.default_rng(12)
    case = make_case(rng, np.float16, q_lens=(2, 1), pasts=(3, 17))
    x = case.inputs
    _, exp_k, exp_v = paged_attention(**full_inputs(x), **case.attrs)
    kc, vc = x["key_cache"], x["value_cache"]
    before = kc.copy()
    kernel.run(x, case.attrs)
    assert x["key_cache"] is kc and not np.array_equal(kc, before)
    np.testing.assert_array_equal(kc.view(np.uint16), exp_k.view(np.uint16))
    np.testing.assert_array_equal(vc.view(np.uint16), exp_v.view(np.uint16))


def test_non_contiguous_cache_refused(kernel) -> None:
    rng = np.random.default_rng(13)
    case = make_case(rng, np.float16, q_lens=(2,), pasts=(3,))
    case.inputs["key_cache"] = np.asfortranarray(case.inputs["key_cache"])
    with pytest.raises(ValueError, match="in place"):
        kernel.run(case.inputs, case.attrs)


# ------------------------------------------------------------------------------------------------ independence
def test_threads_and_batch_never_change_a_sequence(kernel) -> None:
    """Long decodes (split key ranges), short ones and a prefill: identical bits alone or batched, on 1 or 2
    threads. Alone, a short decode's tile is cut by KV heads (a call of fewer than four short decodes); batched,
    it is not."""
    rng = np.random.default_rng(21)
    case = make_case(rng, np.float16, num_heads=8, kv_num_heads=4, head_size=64, q_lens=(1, 1, 6, 1, 1, 1, 1),
                     pasts=(1500, 700, 40, 90, 33, 5, 300), spare_blocks=2)  # fmt: skip
    x, a = case.inputs, case.attrs
    full = full_inputs(x)
    batched = {
        t: kernel.run({k: None if v is None else v.copy() for k, v in full.items()}, a, threads=t) for t in (1, 2)
    }
    np.testing.assert_array_equal(batched[1].view(np.uint16), batched[2].view(np.uint16))
    cu = x["cumulative_sequence_length"]
    for b in range(len(cu) - 1):
        alone = {k: None if v is None else v.copy() for k, v in full.items()}
        s = slice(int(cu[b]), int(cu[b + 1]))
        for name in ("query", "key", "value"):
            alone[name] = full[name][s].copy()
        alone["cumulative_sequence_length"] = np.array([0, s.stop - s.start], np.int32)
        alone["past_seqlens"] = full["past_seqlens"][b : b + 1].copy()
        alone["block_table"] = full["block_table"][b : b + 1].copy()
        out = kernel.run(alone, a, threads=2)
        np.testing.assert_array_equal(out.view(np.uint16), batched[1][s].view(np.uint16), err_msg=f"sequence {b}")


# ------------------------------------------------------------------------------------------------ validation
def _concrete(cases):
    """Cases whose inputs are real arrays (the kernel takes buffers, not symbolic stand-ins) and whose attributes
    a C struct can express (an unknown or mistyped attribute is the custom-op glue's to reject)."""
    out = []
    for case in cases:
        if case.symbolic or case.rule == "type.attribute":
            continue
        inputs, _ = build(case)
        if any(isinstance(v, TensorInfo) for v in inputs.values()):
            continue
        out.append(case)
    return out


VALIDATION = _concrete(ACCEPT + REJECT)


@pytest.mark.parametrize("case", VALIDATION, ids=[c.id for c in VALIDATION])
def test_validation_agrees_with_validator(kernel, case) -> None:
    """Same verdict, rule id and wording as ortpa.ops.validate, with CUDA's num_heads <= 1024 limit off (rule
    1.1.1 is a CUDA thread-block limit; the backend declares max_threads_per_block=0)."""
    inputs, attrs = build(case)
    try:
        check_inputs(inputs, attrs, max_threads_per_block=0)
        expected = None
    except InvalidArgument as e:
        expected = (e.rule, e.message)
    mine = {k: (np.array(v, copy=True) if isinstance(v, np.ndarray) else v) for k, v in inputs.items()}
    try:
        kernel.run(mine, attrs)
        got = None
    except InvalidArgument as e:
        got = (e.rule, e.message)
    if expected is not None and expected[0] == "type.T" and np.dtype(inputs["query"].dtype) == np.float32:
        # float32 activations are the kernel's extension: the mix with float16 inputs is the binding error
        assert got is not None and got[0] == "type.T.bind", got
    elif "num_heads" not in attrs or "kv_num_heads" not in attrs:
        # a C struct has no "absent": a missing required attribute reads as 0 (the glue refuses it first)
        assert got is not None and expected is not None and got[0] == expected[0], (got, expected)
    else:
        assert got == expected
