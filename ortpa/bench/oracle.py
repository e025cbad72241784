"""Oracle speed: LATENT (absorbed MLA) decode at DeepSeek-V3 dimensions.

128 query heads, latent row 576 (512 compressed KV + 64 RoPE channels), v_head_size 512, RoPE in-op at
offset 512, bf16 activations and cache, block size 64, 4 sequences decoding one token each. The oracle must stay
fast enough to check whole-model decode steps; its cost should grow linearly with the context.

``run()`` returns rows ``{name, metric, value, unit, notes}``; ``python -m ortpa.bench.oracle`` prints them.
"""

from __future__ import annotations

import math
import os
import time

import ml_dtypes
import numpy as np

from ortpa.bench.runner import format_table
from ortpa.ops.oracle import paged_attention

__all__ = ["run"]

HEADS, LORA, ROPE, NOPE, BLOCK, BATCH = 128, 512, 64, 128, 64, 4


def _inputs(context: int, seed: int = 0):
    """One decode step: every sequence has ``context - 1`` cached tokens and one new token."""
    rng = np.random.default_rng(seed)
    dt = ml_dtypes.bfloat16
    h = LORA + ROPE
    max_blocks = -(-context // BLOCK)
    num_blocks = BATCH * max_blocks + 8
    block_table = rng.permutation(num_blocks)[: BATCH * max_blocks].reshape(BATCH, max_blocks).astype(np.int32)
    half = ROPE // 2
    ang = np.arange(context + 1)[:, None] / (10000.0 ** (np.arange(half) / half))[None, :]
    args = (
        (rng.standard_normal((BATCH, HEADS * h)) * 0.1).astype(dt),  # query
        (rng.standard_normal((BATCH, h)) * 0.1).astype(dt),  # key: the new latent rows
        None,
        (rng.standard_normal((num_blocks, BLOCK, 1, h)) * 0.1).astype(dt),  # key_cache
        None,
        np.arange(BATCH + 1, dtype=np.int32),  # one token per sequence
        np.full(BATCH, context - 1, np.int32),
        block_table,
    )
    attrs = dict(
        cos_cache=np.cos(ang).astype(dt),
        sin_cache=np.sin(ang).astype(dt),
        num_heads=HEADS,
        kv_num_heads=1,
        kv_cache_layout="LATENT",
        v_head_size=LORA,
        scale=1.0 / math.sqrt(NOPE + ROPE),
        do_rotary=1,
        rotary_interleaved=1,
        rotary_offset=LORA,
    )
    return args, attrs


def _time_call(context: int, repeats: int) -> float:
    args, attrs = _inputs(context)
    paged_attention(*args, **attrs)  # warm-up: page faults, BLAS thread start
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        paged_attention(*args, **attrs)
        best = min(best, time.perf_counter() - t0)
    return best


def run(quick: bool = False) -> list[dict]:
    repeats = 1 if quick else 5
    contexts = (1024, 2048, 4096)
    # OpenBLAS threads spin-wait: on a shared 2-core machine the default thread count can cost several times
    # the single-thread time, so the setting is part of the figure
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or "default"
    env = f"{os.cpu_count()} cpus, BLAS threads {threads}"
    times = {ctx: _time_call(ctx, repeats) for ctx in contexts}
    dims = f"{HEADS} heads, head 576, v 512, rope 64 @512, bf16, block {BLOCK}, {BATCH} seqs"
    rows = [
        {
            "name": f"oracle.latent_decode.ctx{ctx}",
            "metric": "time_per_call",
            "value": round(t, 4),
            "unit": "s",
            "notes": f"{dims}, context {ctx}; best of {repeats}, {env}",
        }
        for ctx, t in times.items()
    ]
    rows.append(
        {
            "name": "oracle.latent_decode.growth",
            "metric": "time_ratio_4k_over_1k",
            "value": round(times[4096] / times[1024], 2),
            "unit": "x",
            "notes": f"linear in context is 4.0; {env}",
        }
    )
    rows.append(
        {
            "name": "oracle.latent_decode.ctx4096",
            "metric": "meets_target",
            "value": int(times[4096] < 0.5),
            "unit": "bool",
            "notes": f"target: < 0.5 s per call on 2 cores; {env}",
        }
    )
    return rows


if __name__ == "__main__":
    import sys

    print(format_table(run(quick="--quick" in sys.argv)))
