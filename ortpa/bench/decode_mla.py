"""Decode step of a converted DeepSeek-V3-shaped MLA model (paged, portable op) vs the dense export, ONNX Runtime CPU.

Model: 16 heads, kv_lora_rank 512, qk_rope 64, qk_nope 128, v_head 128, 2 layers, hidden 1024, vocab 1024, random
weights (``ortpa.testing.dense_mla``). Rows (``run(quick)`` returns them; ``python -m ortpa.bench.decode_mla
[--quick]`` prints a table):

* ``decode_ms/dense/ctxN``: the dense export, one new token with ``past_key_values`` of N tokens (float32
  latent + k_pe); it re-expands the whole latent cache through kv_b_proj every step.
* ``decode_ms/paged/ctxN``: ``ortpa.convert`` of the same model through ``PagedSession`` (aliased caches), one
  new token after N seeded tokens. The sequence's bookkeeping is rebuilt (untimed) before every repeat, so
  every timed step sees exactly N past tokens.
* ``absorption_ratio/ctxN``: dense / paged step time (target >= 10 at 4096). This measures what *absorbing*
  W_UK / W_UV saves (the dense export re-expands the whole latent cache through kv_b_proj every step; the
  converted model attends in the latent space), not what paging saves: paging itself changes where rows live,
  not how many are read. The cost of the un-absorbed alternative on the same paged op is in
  ``ortpa.bench.latent_vs_separate``.
* ``kv_bytes_per_token_layer/*``: cache bytes per token per layer: the dense export's cache as it is, what
  un-absorbed MHA K+V in fp16 would take, and the paged latent cache.
"""

from __future__ import annotations

import math
import os
import sys
import time

import numpy as np
import onnxruntime as ort

from ortpa import convert
from ortpa.bench._timing import row
from ortpa.bench.runner import format_table
from ortpa.providers import CPU
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.session import PagedSession
from ortpa.testing.dense_mla import DenseMlaConfig, build_dense_mla, dense_mla_weights

__all__ = ["run"]

BS = 16
CONFIG = DenseMlaConfig(
    hidden=1024,
    layers=2,
    heads=16,
    q_lora_rank=512,
    kv_lora_rank=512,
    qk_nope=128,
    qk_rope=64,
    v_head=128,
    vocab=1024,
    intermediate=1024,
    max_position_embeddings=4096 + 64,
)


def _best_ms(fn, repeats: int, setup=None) -> float:
    if setup:
        setup()
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        if setup:
            setup()
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


def _dense_step(sess: ort.InferenceSession, ctx: int, rng):
    c = CONFIG
    feed = {
        "input_ids": np.array([[int(rng.integers(c.vocab))]], np.int64),
        "attention_mask": np.ones((1, ctx + 1), np.int64),
        "position_ids": np.array([[ctx]], np.int64),
    }
    for i in range(c.layers):
        feed[f"past_key_values.{i}.key"] = rng.standard_normal((1, 1, ctx, c.kv_lora_rank)).astype(np.float32)
        feed[f"past_key_values.{i}.value"] = rng.standard_normal((1, 1, ctx, c.qk_rope)).astype(np.float32)
    return lambda: sess.run(["logits"], feed)


class _PagedStep:
    def __init__(self, sess: PagedSession, ctx: int, rng) -> None:
        self.sess, self.ctx = sess, ctx
        self.token = np.array([int(rng.integers(CONFIG.vocab))], np.int64)
        self.declared = {i.name for i in sess.session.get_inputs()}
        self.kv: PagedKVCache | None = None

    def setup(self) -> None:  # fresh bookkeeping: the step always sees exactly ctx past tokens
        self.kv = PagedKVCache(self.sess.num_blocks, self.sess.block_size)
        self.kv.add_sequence(0, num_tokens=self.ctx)

    def __call__(self) -> None:
        step = self.kv.plan_step([(0, 1)])
        feed = step.model_feeds(
            self.token,
            attention_metadata="attention_metadata" in self.declared,
            position_ids="position_ids" in self.declared,
        )
        self.sess.run(feed, ["logits"])


def run(quick: bool = False) -> list[dict]:
    c = CONFIG
    rng = np.random.default_rng(0)
    repeats = 3 if quick else 5
    contexts = (256, 1024) if quick else (256, 1024, 4096)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    dense_model = build_dense_mla(c, dense_mla_weights(c))
    dense = ort.InferenceSession(dense_model.SerializeToString(), so, providers=[CPU])
    paged_model = convert(dense_model)
    num_blocks = -(-(max(contexts) + 1) // BS) + 4
    paged = PagedSession(paged_model, num_blocks=num_blocks, block_size=BS, providers=[CPU])
    for name in paged.cache_names:  # random cache contents: the step attends over real-looking rows
        shape, dtype = paged.cache(name).shape, paged.cache(name).dtype
        paged.write_cache(name, (rng.standard_normal(shape) * 0.5).astype(dtype))

    threads = os.environ.get("OMP_NUM_THREADS") or "default"
    env = f"{os.cpu_count()} cpus, threads {threads}, best of {repeats}"
    dims = f"{c.heads} heads, L {c.kv_lora_rank}, rope {c.qk_rope}, {c.layers} layers, hidden {c.hidden}"
    rows: list[dict] = []
    for ctx in contexts:
        d_ms = _best_ms(_dense_step(dense, ctx, rng), repeats)
        step = _PagedStep(paged, ctx, rng)
        p_ms = _best_ms(step, repeats, setup=step.setup)
        rows.append(row(f"decode_ms/dense/ctx{ctx}", "step_time", d_ms, "ms", f"{dims}, fp32 past/present; {env}"))
        rows.append(row(f"decode_ms/paged/ctx{ctx}", "step_time", p_ms, "ms", f"{dims}, block {BS}; {env}"))
        target = "; target >= 10" if ctx == 4096 else ""
        rows.append(
            row(f"absorption_ratio/ctx{ctx}", "dense_export_over_absorbed_paged", d_ms / p_ms, "x",
                 f"absorption saving (not paging); batch 1, one new token{target}")
        )  # fmt: skip

    cache = paged.cache(paged.cache_names[0])
    paged_bytes = cache.dtype.itemsize * int(np.prod(cache.shape[2:]))
    per = "bytes per token per layer"
    rows.append(
        row("kv_bytes_per_token_layer/dense_export", "bytes", (c.kv_lora_rank + c.qk_rope) * 4, "B",
             f"{per}: latent {c.kv_lora_rank} + k_pe {c.qk_rope}, float32, as exported")
    )  # fmt: skip
    rows.append(
        row("kv_bytes_per_token_layer/mha_fp16", "bytes", c.heads * (c.qk_nope + c.qk_rope + c.v_head) * 2, "B",
             f"{per}: un-absorbed MHA K ({c.qk_nope + c.qk_rope}) + V ({c.v_head}) x {c.heads} heads, fp16")
    )  # fmt: skip
    rows.append(
        row("kv_bytes_per_token_layer/paged", "bytes", paged_bytes, "B",
             f"{per}: LATENT cache row {tuple(cache.shape[2:])} {cache.dtype}")
    )  # fmt: skip
    return rows


if __name__ == "__main__":
    print(format_table(run(quick="--quick" in sys.argv[1:])))
