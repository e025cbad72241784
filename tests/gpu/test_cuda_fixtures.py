"""Converted fixture models natively on CUDA (IO-bound aliased caches) against the portable op on CPU.

Every real export in ``tests/fixtures`` is converted, then driven through :func:`parity.run_parity` twice with
the same prompts, block order and token history (``follow_reference``: both runs continue with the dense
model's greedy token): once on the CUDA execution provider, where every PagedAttention node must run on the
native kernel and the caches are device OrtValues bound as input and output, and once on CPU through the
portable lowering. Both runs are checked against the dense export, and against each other logit by logit.

Run on a GPU machine with ``scripts/gpu_check.sh``. Without a CUDA device there is nothing to compare (CPU
against CPU is the same computation), so every test here carries the ``cuda`` marker; the parity driver itself
runs in every CI job through the rewriter tests.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.parity import FIXTURES, run_parity
from support.tolerances import assert_close, precision_logit_bound

from ortpa.rewriter.pipeline import convert
from ortpa.runtime.session import PagedSession

CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
CPU = ["CPUExecutionProvider"]

# One conversion per fixture with default options, plus RoPE inside the op (the native kernel's own RoPE).
CASES = [
    ("dsv3_sdpa_op18", {}),
    ("dsv3_eager_op18", {}),
    ("dsv3_sdpa_op23", {}),
    ("dsv3_sdpa_op18", {"rope_in_op": True}),
    ("dsv3_sdpa_op18_noil_noqlora", {"absorb": "matmul"}),
    ("dsv3_sdpa_op18_rope32", {"rope_in_op": True, "absorb": "matmul"}),
    ("kimi_sdpa_op18", {"absorb": "fold"}),
    ("glm4moelite_sdpa_op18", {}),
    ("minicpm3_sdpa_op18", {}),
    ("llama_sdpa_op18", {}),
    ("llama_sdpa_op18", {"rope_in_op": True}),
    ("llama_mha_eager_op18", {}),
    ("llama_sdpa_op23", {}),
    ("qwen3_sdpa_op18", {}),
    ("qwen3_sdpa_op18", {"rope_in_op": True}),
    ("qwen2_sliding_sdpa_op18", {}),
    ("gemma2_eager_op18", {}),
]
_IDS = [f + ("+" + ",".join(o) if o else "") for f, o in CASES]


def native_vs_portable(fixture: str, options: dict, providers: list[str]) -> float:
    """Run the converted fixture on ``providers`` and on CPU; return the max |logit difference| between them."""
    dense = FIXTURES / f"{fixture}.onnx"
    converted = convert(str(dense), **options)
    extra = precision_logit_bound("float16")  # two float16 kernels: each within the precision rule's bound
    sess = PagedSession(converted, num_blocks=4, block_size=16, providers=providers)
    assert sess.device == "cuda", f"{fixture}: caches are not on the device"
    assert not sess.session.portable_nodes, f"{fixture}: not native on CUDA: {sess.session.portable_nodes}"
    run = dict(scatter_blocks=True, follow_reference=True, seed=3)
    native = run_parity(converted, dense, providers=providers, **run)
    portable = run_parity(converted, dense, providers=CPU, paged_attention="portable", **run)
    assert len(native.logits) == len(portable.logits) == native.tokens_checked
    worst = 0.0
    for i, (a, b) in enumerate(zip(native.logits, portable.logits, strict=True)):
        assert_close(a, b, np.float16, what=f"{fixture}: row {i}, native vs portable", extra_atol=extra)
        worst = max(worst, float(np.abs(a - b).max()))
    return worst


@pytest.mark.cuda
@pytest.mark.parametrize(("fixture", "options"), CASES, ids=_IDS)
def test_converted_fixture_native_cuda_matches_portable_cpu(fixture, options):
    worst = native_vs_portable(fixture, options, CUDA)
    print(f"{fixture} {options}: max |native - portable| = {worst:.2e}")
