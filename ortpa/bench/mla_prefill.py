"""MLA prefill and decode of converted models against the dense export, at DeepSeek-V2-Lite attention dimensions.

Model (``ortpa.testing.dense_mla``, random weights): hidden 2048, 16 heads, kv_lora_rank 512, qk_nope 128,
qk_rope 64, v_head 128, no q LoRA (V2-Lite), dense MLP (intermediate 4096), 2 layers, vocab 1024. Three models:
the dense export, and ``ortpa.convert`` of it with ``mla_prefill="expanded"`` (the default) and ``"absorbed"``,
both through ``PagedSession`` (portable op, aliased caches) on ONNX Runtime CPU. Rows, side by side in one run:

* ``prefill_ms/{dense,expanded,absorbed}/N``: one fresh N-token prompt (median CPU time of the process,
  ``time.process_time``, the three run round-robin so outside load hits them alike);
  ``prefill_ratio/{expanded,absorbed}/N``: converted / dense (target <= 1.0);
* ``decode_ms/{dense,expanded,absorbed}/ctxN``: one new token after N cached ones;
  ``decode_speedup/{expanded,absorbed}/ctxN``: dense / converted (target >= 10 at 4096); the expanded model's
  decode row is what a step with no fresh rows pays for carrying the expanded branch;
* ``attention_gflop_per_token/{absorbed,expanded}/N`` and ``attention_flop_ratio/N``: exact, from the shapes
  (:func:`ortpa.rewriter.mla_expanded.attention_flops_per_token`), so they hold on any machine.

``ORTPA_BENCH_MLA_FORMS=expanded`` converts one form only; ``ORTPA_BENCH_REPEATS`` sets the repeats (a busy
machine at long lengths). ``ORTPA_BENCH_PROVIDER=cuda`` runs all three on CUDA (wall time then;
``scripts/gpu_check.sh``).
Lengths: 256 and 1024 with ``quick``; 256, 1024, 2048, 4096 otherwise; ``ORTPA_BENCH_MLA_LENGTHS`` (comma list)
overrides. At 8192 the dense export holds ~3 x 4 GiB of float32 scores per layer, the expanded model a quarter of
that (its query blocks, ``ortpa.rewriter.mla_expanded.QUERY_BLOCKS``); the absorbed one is ~3x dense's time
there (``ORTPA_BENCH_MLA_FORMS=expanded`` leaves it out).
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import onnxruntime as ort

from ortpa.bench._timing import interleaved_ms, row
from ortpa.bench.runner import format_table
from ortpa.rewriter.mla_expanded import attention_flops_per_token
from ortpa.rewriter.pipeline import convert
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.session import PagedSession
from ortpa.testing.dense_mla import DenseMlaConfig, build_dense_mla, dense_mla_weights

__all__ = ["CONFIG", "run"]

BS = 16
THREADS = 2
CONFIG = DenseMlaConfig(
    hidden=2048,
    layers=2,
    heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope=128,
    qk_rope=64,
    v_head=128,
    vocab=1024,
    intermediate=4096,
    max_position_embeddings=8192 + 64,
)


def _options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = THREADS
    # no arena: three sessions each keeping a long prompt's peak (GiBs of scores) would hold it all at once
    so.enable_cpu_mem_arena = False
    return so


def _dense_feed(n: int, past: int, rng) -> dict:
    c = CONFIG
    feed = {
        "input_ids": rng.integers(0, c.vocab, (1, n)).astype(np.int64),
        "attention_mask": np.ones((1, past + n), np.int64),
        "position_ids": np.arange(past, past + n, dtype=np.int64)[None],
    }
    for i in range(c.layers):
        feed[f"past_key_values.{i}.key"] = (rng.standard_normal((1, 1, past, c.kv_lora_rank)) * 0.5).astype(np.float32)
        feed[f"past_key_values.{i}.value"] = (rng.standard_normal((1, 1, past, c.qk_rope)) * 0.5).astype(np.float32)
    return feed


class _Paged:
    """One sequence through a converted model: ``n`` new tokens after ``past`` cached ones (bookkeeping rebuilt
    before each run, so every run sees the same state; the cache holds random rows)."""

    def __init__(self, sess: PagedSession, n: int, past: int, rng) -> None:
        self.sess, self.n, self.past = sess, n, past
        self.ids = rng.integers(0, CONFIG.vocab, n).astype(np.int64)
        self.declared = {i.name for i in sess.session.get_inputs()}

    def __call__(self) -> None:
        kv = PagedKVCache(self.sess.num_blocks, self.sess.block_size)
        kv.add_sequence(0, num_tokens=self.past)
        step = kv.plan_step([(0, self.n)])
        feed = step.model_feeds(
            self.ids,
            attention_metadata="attention_metadata" in self.declared,
            position_ids="position_ids" in self.declared,
        )
        self.sess.run(feed, ["logits"])


def _provider() -> tuple[list[str], object, str]:
    """(providers, clock, what the clock measures) from ``ORTPA_BENCH_PROVIDER`` (``cpu`` or ``cuda``)."""
    if os.environ.get("ORTPA_BENCH_PROVIDER", "cpu") == "cuda":
        return ["CUDAExecutionProvider", "CPUExecutionProvider"], time.perf_counter, "CUDA, wall time"
    return ["CPUExecutionProvider"], time.process_time, f"{THREADS} ORT threads, CPU time"


def _lengths(quick: bool) -> tuple[int, ...]:
    env = os.environ.get("ORTPA_BENCH_MLA_LENGTHS")
    if env:
        return tuple(int(x) for x in env.split(","))
    return (256, 1024) if quick else (256, 1024, 2048, 4096)


def run(quick: bool = False) -> list[dict]:
    c = CONFIG
    rng = np.random.default_rng(0)
    repeats = int(os.environ.get("ORTPA_BENCH_REPEATS", 3 if quick else 5))
    forms = os.environ.get("ORTPA_BENCH_MLA_FORMS", "expanded,absorbed").split(",")
    lengths = _lengths(quick)
    dense_model = build_dense_mla(c, dense_mla_weights(c))
    providers, clock, clock_note = _provider()
    dense = ort.InferenceSession(dense_model.SerializeToString(), _options(), providers=providers)
    num_blocks = -(-(max(lengths) + 1) // BS) + 4
    paged = {}
    for form in forms:
        sess = PagedSession(
            convert(dense_model, mla_prefill=form, providers=()),
            num_blocks=num_blocks,
            block_size=BS,
            providers=providers,
            sess_options=_options(),
        )
        for name in sess.cache_names:  # random cache contents: decode attends over real-looking rows
            shape, dtype = sess.cache(name).shape, sess.cache(name).dtype
            sess.write_cache(name, (rng.standard_normal(shape) * 0.5).astype(dtype))
        paged[form] = sess
    del dense_model

    dims = f"{c.heads} heads, L {c.kv_lora_rank}, nope {c.qk_nope}, rope {c.qk_rope}, v {c.v_head}, {c.layers} layers"
    env = f"{clock_note}, median of {repeats} interleaved"
    flops = {k: getattr(c, k) for k in ("kv_lora_rank", "qk_nope", "qk_rope", "v_head")}
    rows: list[dict] = []
    for n in lengths:
        feed = _dense_feed(n, 0, rng)
        fns = {"dense": lambda feed=feed: dense.run(["logits"], feed)}
        fns.update({form: _Paged(sess, n, 0, rng) for form, sess in paged.items()})
        ms = interleaved_ms(fns, repeats, clock=clock)
        for k, v in ms.items():
            rows.append(row(f"prefill_ms/{k}/{n}", "prefill_time", v, "ms", f"{dims}; fresh {n}-token prompt; {env}"))
        for form in paged:
            rows.append(
                row(f"prefill_ratio/{form}/{n}", "converted_over_dense", ms[form] / ms["dense"], "x",
                    "target <= 1.0 (dense computes logits for every token, the converted models for the last)")
            )  # fmt: skip
        fl = attention_flops_per_token(n, num_heads=c.heads, **flops)
        for form in ("absorbed", "expanded"):
            rows.append(row(f"attention_gflop_per_token/{form}/{n}", "flops", fl[form] / 1e9, "GFLOP", dims))
        rows.append(row(f"attention_flop_ratio/{n}", "absorbed_over_expanded", fl["ratio"], "x", "exact, from shapes"))
    for n in lengths:
        feed = _dense_feed(1, n, rng)
        fns = {"dense": lambda feed=feed: dense.run(["logits"], feed)}
        fns.update({form: _Paged(sess, 1, n, rng) for form, sess in paged.items()})
        ms = interleaved_ms(fns, repeats, clock=clock)
        for k, v in ms.items():
            rows.append(row(f"decode_ms/{k}/ctx{n}", "step_time", v, "ms", f"{dims}; one token after {n}; {env}"))
        for form in paged:
            target = "; target >= 10" if n == 4096 else ""
            rows.append(
                row(f"decode_speedup/{form}/ctx{n}", "dense_over_converted", ms["dense"] / ms[form], "x",
                    f"batch 1{target}")
            )  # fmt: skip
    return rows


if __name__ == "__main__":
    print(format_table(run(quick="--quick" in sys.argv[1:])))
