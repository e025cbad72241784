"""The quantized caches through a real ONNX Runtime session on the native kernel, against the NumPy oracle.

``test_native_kernel`` holds the kernel to the oracle through ctypes; here the same cases (its ``QUANT`` configs:
PER_TENSOR, PER_CHANNEL with RoPE, GQA decode; int8, float8 e4m3fn and packed int4 caches, float16 and bfloat16
activations, SEPARATE; LATENT with int8 and float8) run as a one-node ``com.microsoft::PagedAttention`` model in
``ortpa.InferenceSession`` with ``paged_attention="native"``: ONNX Runtime binds the node to the library's op for
its (activation, cache) type pair, reads the attributes, runs it. Outputs within ``ortpa/tolerances.py``'s
tolerance, caches bit for bit. LATENT with an int4 cache is not defined by the op (``ortpa.ops.validate``): the
session refuses it before it opens, as the oracle does.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from ops.test_portable import make_case
from support.tolerances import assert_close
from test_native_kernel import QUANT, full_inputs, requantize

from ortpa.errors import NotImplementedByBackend
from ortpa.ops.oracle import paged_attention
from ortpa.ops.portable import paged_attention_model
from ortpa.runtime.session import InferenceSession

CPU = ["CPUExecutionProvider"]
BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16]
KINDS = ["int8", "float8e4m3fn", "int4"]


def _run_native(x: dict, attrs: dict) -> list[np.ndarray]:
    sess = InferenceSession(paged_attention_model(x, attrs), providers=CPU, paged_attention="native")
    assert set(sess.implementations.values()) == {"native-cpu"}
    return sess.run(None, x)


def _assert_matches_oracle(x: dict, attrs: dict, dtype) -> None:
    expected = paged_attention(**full_inputs(x), **attrs)
    before = {k: v.copy() for k, v in x.items()}
    got = _run_native(x, attrs)
    assert len(got) == len([e for e in expected if e is not None])
    out, *caches = got
    assert out.dtype == expected[0].dtype and out.shape == expected[0].shape
    assert_close(out, expected[0], dtype, what="output")
    for name, cache, ref in zip(("key_cache_out", "value_cache_out"), caches, expected[1:], strict=False):
        assert cache.dtype == ref.dtype, name
        np.testing.assert_array_equal(cache.view(np.uint8), ref.view(np.uint8), err_msg=name)
    for name, value in x.items():  # a plain run updates copies: the caller's arrays stay as they were
        np.testing.assert_array_equal(value.view(np.uint8), before[name].view(np.uint8), err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(QUANT))
def test_quantized_separate_caches_in_a_session(name: str, kind: str, dtype) -> None:
    rng = np.random.default_rng(sum(map(ord, name + kind)))
    case = make_case(rng, dtype, **QUANT[name])
    if kind != "int8":
        requantize(case, kind)
    _assert_matches_oracle(case.inputs, case.attrs, dtype)


def _latent_case(kind: str, seed: int):
    case = make_case(
        np.random.default_rng(seed), BF16, latent=True, num_heads=4, kv_num_heads=1, head_size=64, v_head_size=48,
        quant=("int8", "PER_CHANNEL", ""), rotary=(16, False, 48), q_lens=(3, 1), pasts=(0, 40), scale=0.125,
    )  # fmt: skip
    if kind != "int8":
        requantize(case, kind)
    return case


@pytest.mark.parametrize("kind", ["int8", "float8e4m3fn"])
def test_quantized_latent_cache_in_a_session(kind: str) -> None:
    case = _latent_case(kind, 5)
    _assert_matches_oracle(case.inputs, case.attrs, BF16)


def test_latent_int4_is_refused_before_the_session_opens() -> None:
    case = _latent_case("int4", 6)
    with pytest.raises(NotImplementedByBackend):  # the op does not define it: neither does the oracle
        paged_attention(**full_inputs(case.inputs), **case.attrs)
    with pytest.raises(NotImplementedByBackend, match="int4"):
        _run_native(case.inputs, case.attrs)
