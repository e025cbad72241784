"""CUDA-only checks (marker `cuda`; skipped where no CUDA device is present): the native kernel against the
oracle and against the portable op on the same inputs, and the aliased PagedSession on the device.

Run them on a GPU machine with `scripts/gpu_check.sh`.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from support.tolerances import assert_close

from ortpa.ops.oracle import paged_attention
from ortpa.ops.portable import paged_attention_model
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.session import InferenceSession, PagedSession

pytestmark = pytest.mark.cuda

CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
CPU = ["CPUExecutionProvider"]
NB, BS = 16, 16


def _case(rng, dtype, *, nh, kvh, h, q_lens, past, latent=False, v_head=0):
    t = sum(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    width = max(-(-(p + q) // BS) for p, q in zip(past, q_lens, strict=True))
    bt = rng.permutation(NB)[: len(q_lens) * width].reshape(len(q_lens), width).astype(np.int32)
    x = {
        "query": rng.standard_normal((t, nh * h)).astype(dtype),
        "key": rng.standard_normal((t, kvh * h)).astype(dtype),
        "key_cache": rng.standard_normal((NB, BS, kvh, h)).astype(dtype),
        "cumulative_sequence_length": cu,
        "past_seqlens": np.asarray(past, np.int32),
        "block_table": bt,
    }
    attrs = {"num_heads": nh, "kv_num_heads": kvh}
    if latent:
        attrs.update(kv_cache_layout="LATENT", v_head_size=v_head, scale=float(h) ** -0.5)
    else:
        x["value"] = rng.standard_normal((t, kvh * h)).astype(dtype)
        x["value_cache"] = rng.standard_normal((NB, BS, kvh, h)).astype(dtype)
    return x, attrs


CASES = {
    "mha": dict(nh=4, kvh=4, h=64, q_lens=[5, 1, 9], past=[0, 20, 33]),
    "gqa": dict(nh=8, kvh=2, h=128, q_lens=[1, 1, 1], past=[15, 47, 100]),
    "latent": dict(nh=8, kvh=1, h=576, q_lens=[3, 1], past=[0, 40], latent=True, v_head=512),
}


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_native_kernel_matches_oracle_and_portable(case, dtype):
    x, attrs = _case(np.random.default_rng(0), dtype, **CASES[case])
    model = paged_attention_model(x, attrs)
    native = InferenceSession(model, providers=CUDA)
    assert native.native_nodes == ["PagedAttention_0"], "CUDA should run the node natively"
    portable = InferenceSession(model, providers=CPU)
    got = native.run(None, x)
    port = portable.run(None, x)
    ref = paged_attention(**x, **attrs)
    assert_close(got[0], ref[0], dtype, what=f"{case}: native vs oracle")
    assert_close(got[0], port[0], dtype, what=f"{case}: native vs portable")
    for i in range(1, len(ref)):
        if ref[i] is not None:
            assert_close(got[i], ref[i], dtype, what=f"{case}: cache {i}")


def test_aliased_session_on_cuda_updates_in_place():
    rng = np.random.default_rng(1)
    x, attrs = _case(rng, np.float16, **CASES["gqa"])
    sess = PagedSession(paged_attention_model(x, attrs), num_blocks=NB, block_size=BS, providers=CUDA)
    assert sess.device == "cuda"
    ptrs = sess.data_ptrs()
    kv = PagedKVCache(NB, BS)
    ref = {name: sess.cache(name) for name in sess.cache_names}
    for s in range(2):
        kv.add_sequence(s)
    for step, q_lens in enumerate([[6, 11], [1, 1], [1, 1], [1, 1]]):
        plan = kv.plan_step([(0, q_lens[0]), (1, q_lens[1])])
        t = plan.num_tokens
        feeds = {
            "query": rng.standard_normal((t, 8 * 128)).astype(np.float16),
            "key": rng.standard_normal((t, 2 * 128)).astype(np.float16),
            "value": rng.standard_normal((t, 2 * 128)).astype(np.float16),
            "cumulative_sequence_length": plan.cumulative_sequence_length,
            "past_seqlens": plan.past_seqlens,
            "block_table": plan.block_table,
        }
        got = sess.run(feeds)
        out, ref["key_cache"], ref["value_cache"] = paged_attention(
            **feeds, key_cache=ref["key_cache"], value_cache=ref["value_cache"], **attrs
        )
        assert_close(got["output"], out, np.float16, what=f"step {step}")
        assert sess.data_ptrs() == ptrs
    for name in sess.cache_names:
        assert_close(sess.cache(name), ref[name], np.float16, what=name)
