"""Engine throughput on CPU: continuous batching vs one request at a time, decode latency while prompts arrive,
and prefix-cache savings.

Model: the toy paged LM (``ortpa.testing.toy_lm``) at hidden 256, 4 heads (2 KV heads), 4 layers, vocab 512,
fp16 attention through the portable PagedAttention. Workloads, all greedy:

* ``mixed``: 64 requests, prompts 8..128 tokens, 8..48 new tokens each, all queued at once; run by one engine
  with its defaults (continuous batching, prompt chunks and decodes mixed in steps of <= 256 tokens) and one
  request at a time (``generate([p])`` in a loop, whole prompt in one step, warmed up like the batched runs),
  prefix caching off. Target: batching >= 3x the sequential tokens/s. The same engine with ``mixed_steps=False``
  (prompt chunks and decodes in separate steps, prompts first) is reported beside it.
* ``arrivals``: the ``mixed`` requests arrive one every ``ARRIVAL_MS`` of engine CPU time instead of all at
  once; inter-token latency (CPU time between two tokens of one request, after its first) at p50 / p99, with
  mixed steps (the default) and with separate steps: separate steps stall every decode while a prompt runs.
* ``host``: the share of a decode step spent outside ONNX Runtime's run (index tensors, sampling, the Python
  between runs) at 1 and 16 requests (``engine.host.N``), the toy model's steps being short enough for the driver
  loop to show.
* ``shared_prefix``: 64 requests sharing a 96-token system prompt (6 blocks of 16) plus 8..40 own tokens;
  the default engine with prefix caching on and off. Reports the share of prompt tokens served from the
  cache and the compute (tokens fed through the model) saved.

Times are CPU seconds of this process with one ONNX Runtime thread (see ``_engine``), so figures hold on a
busy shared machine. ``run()`` returns rows ``{name, metric, value, unit, notes}``;
``python -m ortpa.bench.engine`` (or ``ortpa bench --only engine``) prints them.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import onnxruntime as ort

from ortpa.bench import format_table
from ortpa.bench._timing import decode_host_share
from ortpa.providers import CPU as CPU_PROVIDER
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

__all__ = ["run"]

CONFIG = ToyLMConfig(vocab=512, hidden=256, num_heads=4, kv_heads=2, num_layers=4, max_positions=512)
BLOCK, NUM_BLOCKS = 16, 1024
BUDGET = 256  # tokens per step: small enough that these prompts run in chunks beside decodes
ARRIVAL_MS = 15.0  # CPU time between two arrivals in the ``arrivals`` workload
CPU = [CPU_PROVIDER]


def _mixed(n: int, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, CONFIG.vocab, size=rng.integers(8, 129))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(8, 49))) for _ in range(n)]
    return prompts, params


def _shared_prefix(n: int, seed: int = 1) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = np.random.default_rng(seed)
    system = [int(t) for t in rng.integers(0, CONFIG.vocab, size=6 * BLOCK)]
    prompts = [system + [int(t) for t in rng.integers(0, CONFIG.vocab, size=rng.integers(8, 41))] for _ in range(n)]
    return prompts, [SamplingParams(max_new_tokens=16)] * n


def _engine(model, prefix: bool, mixed: bool = True) -> Engine:
    # One ONNX Runtime thread: on a shared 2-core machine spinning worker threads make wall time swing
    # several-fold with the neighbours' load; single-threaded CPU time (what _timed measures) does not.
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    return Engine(
        model,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        providers=CPU,
        max_num_batched_tokens=BUDGET,
        enable_prefix_caching=prefix,
        sess_options=opts,
        mixed_steps=mixed,
    )


def _warm_generate(engine: Engine, prompts, params, repeats: int = 1):
    """Best of ``repeats`` runs after a short warm-up (first-run allocations in ONNX Runtime).

    Returns (outputs, seconds, steps of one run). Prefix caching must be off: a repeat would hit the cache.
    """
    engine.generate(prompts[:2], params[:2])
    best = float("inf")
    for _ in range(repeats):
        steps = engine.stats.steps
        out, t = _timed(lambda: engine.generate(prompts, params))
        best = min(best, t)
    return out, best, engine.stats.steps - steps


def _sequential(engine: Engine, prompts, params, repeats: int = 1):
    """Best of ``repeats`` runs of the prompts one at a time, after the same warm-up; (outputs, seconds)."""
    for p, s in zip(prompts[:2], params[:2], strict=True):
        engine.generate([p], s)
    best, out = float("inf"), []
    for _ in range(repeats):
        out, t = _timed(lambda: [engine.generate([p], s)[0] for p, s in zip(prompts, params, strict=True)])
        best = min(best, t)
    return out, best


def _arrivals(engine: Engine, prompts, params) -> tuple[list[list[int]], list[float]]:
    """Requests arrive one every ``ARRIVAL_MS`` of this process's CPU time while the engine steps.

    Returns (outputs in prompt order, inter-token gaps in ms of every request after its first token).
    """
    engine.generate(prompts[:2], params[:2])
    t0 = time.process_time()
    ids: list[str] = []
    stamps: dict[str, list[float]] = {}
    outputs: dict[str, list[int]] = {}
    while len(ids) < len(prompts) or engine.has_unfinished():
        now = 1e3 * (time.process_time() - t0)
        while len(ids) < len(prompts) and (now >= ARRIVAL_MS * len(ids) or not engine.has_unfinished()):
            rid = engine.add_request(prompts[len(ids)], params[len(ids)])
            ids.append(rid)
            stamps[rid], outputs[rid] = [], []
        for out in engine.step():
            stamps[out.request_id].append(1e3 * (time.process_time() - t0))
            outputs[out.request_id].extend(out.new_token_ids)
    gaps = [b - a for rid in ids for a, b in itertools.pairwise(stamps[rid])]
    return [outputs[i] for i in ids], gaps


def _timed(fn):
    """(result, CPU seconds of this process): stable under other processes' load, unlike wall time."""
    t0 = time.process_time()
    out = fn()
    return out, time.process_time() - t0


def run(quick: bool = False) -> list[dict]:
    n = 16 if quick else 64
    env = f"{os.cpu_count()} cpus, 1 ORT thread, CPU time"
    model = build_toy_lm(CONFIG)
    dims = f"toy LM hidden {CONFIG.hidden}, {CONFIG.num_layers} layers, vocab {CONFIG.vocab}, block {BLOCK}"

    prompts, params = _mixed(n)
    repeats = 1 if quick else 2
    default, t_default, steps_default = _warm_generate(_engine(model, False), prompts, params, repeats)
    separate, t_separate, steps_separate = _warm_generate(_engine(model, False, False), prompts, params, repeats)
    sequential, t_seq = _sequential(_engine(model, False), prompts, params, repeats)
    generated = sum(len(o) for o in default)
    same = default == sequential == separate
    speedup = t_seq / t_default

    gaps: dict[bool, list[float]] = {True: [], False: []}
    same_arrivals = {True: True, False: True}
    for _ in range(repeats):  # interleaved, gaps pooled: outside load hits both policies alike
        for mixed in (True, False):
            out, g = _arrivals(_engine(model, False, mixed), prompts, params)
            gaps[mixed] += g
            same_arrivals[mixed] &= out == default
    latency = {m: (np.percentile(gaps[m], 50), np.percentile(gaps[m], 99), same_arrivals[m]) for m in gaps}

    shared, shared_params = _shared_prefix(n)
    results = {}
    for prefix in (False, True):
        eng = _engine(model, prefix)
        eng.generate(shared[:1], shared_params[:1])  # warm-up; then reset, so the measured run starts cold
        eng.reset_prefix_cache()
        before = eng.stats
        out, t = _timed(lambda eng=eng: eng.generate(shared, shared_params))
        after = eng.stats
        results[prefix] = (
            out,
            t,
            after.computed_tokens - before.computed_tokens,
            after.cached_tokens - before.cached_tokens,
            after.prompt_tokens - before.prompt_tokens,
        )
    out_off, t_off, computed_off, _, prompt_tokens = results[False]
    out_on, t_on, computed_on, cached_on, _ = results[True]

    mixed_note = f"{n} requests, prompts 8-128, 8-48 new tokens, {generated} tokens; {dims}; {env}, best of {repeats}"
    arrival_note = (
        f"one arrival per {ARRIVAL_MS:g} ms CPU; gaps between tokens of one request after its first, "
        f"{repeats} run(s) pooled"
    )
    rows = [
        {
            "name": "engine.mixed.batched",
            "metric": "throughput",
            "value": round(generated / t_default, 1),
            "unit": "tokens/s",
            "notes": f"{mixed_note}; Engine defaults (mixed steps of <= {BUDGET} tokens); {t_default:.2f} s, "
            f"{steps_default} steps",
        },
        {
            "name": "engine.mixed.batched_separate_steps",
            "metric": "throughput",
            "value": round(generated / t_separate, 1),
            "unit": "tokens/s",
            "notes": f"mixed_steps=False (prompt chunks and decodes in separate steps of <= {BUDGET} tokens); "
            f"{t_separate:.2f} s, {steps_separate} steps",
        },
        {
            "name": "engine.mixed.sequential",
            "metric": "throughput",
            "value": round(generated / t_seq, 1),
            "unit": "tokens/s",
            "notes": f"one request at a time, whole prompt per step, warmed up; {t_seq:.2f} s; "
            f"outputs identical: {same}",
        },
        {
            "name": "engine.mixed",
            "metric": "batching_speedup",
            "value": round(speedup, 2),
            "unit": "x",
            "notes": f"Engine defaults over sequential; target >= 3x; meets target: {speedup >= 3.0}; "
            f"separate steps: {t_seq / t_separate:.2f}x",
        },
    ]
    for mixed, label in ((True, "mixed_steps"), (False, "separate_steps")):
        p50, p99, ok = latency[mixed]
        for q, v in (("p50", p50), ("p99", p99)):
            rows.append(
                {
                    "name": f"engine.arrivals.{label}",
                    "metric": f"inter_token_latency_{q}",
                    "value": round(float(v), 2),
                    "unit": "ms",
                    "notes": f"{arrival_note}; mixed_steps={mixed}; outputs identical: {ok}",
                }
            )
    rows += [
        {
            "name": "engine.shared_prefix",
            "metric": "prefix_hit_rate",
            "value": round(100.0 * cached_on / prompt_tokens, 1),
            "unit": "%",
            "notes": f"{n} requests, 96-token shared prefix + 8-40 own tokens; {cached_on} of {prompt_tokens} "
            f"prompt tokens from the cache",
        },
        {
            "name": "engine.shared_prefix",
            "metric": "compute_saved",
            "value": round(100.0 * (computed_off - computed_on) / computed_off, 1),
            "unit": "%",
            "notes": f"tokens fed through the model: {computed_on} with prefix caching, {computed_off} without; "
            f"outputs identical: {out_on == out_off}",
        },
        {
            "name": "engine.shared_prefix",
            "metric": "prefix_cache_speedup",
            "value": round(t_off / t_on, 2),
            "unit": "x",
            "notes": f"{t_on:.2f} s with prefix caching, {t_off:.2f} s without; {env}",
        },
    ]
    rows += _host_rows(model, dims)
    return rows


def _host_rows(model, dims: str) -> list[dict]:
    """``engine.host.N``: the share of a decode step spent outside ONNX Runtime's run, at 1 and 16 requests, with
    the bound decode feeds (the default) and, in the notes, with feeds rebuilt every step."""
    rows = []
    for n in (1, 16):
        prompts = _mixed(n, seed=2)[0]
        got = {}
        for bound in (True, False):
            engine = _engine(model, False)
            if not bound:
                engine._decode_feeds = None  # the path every step took before the bound decode feeds
            got[bound] = decode_host_share(engine, prompts, 32)
        h, old = got[True], got[False]
        rows.append(
            {
                "name": f"engine.host.{n}",
                "metric": "host_share",
                "value": round(100.0 * h.share, 1),
                "unit": "%",
                "notes": f"{n} request(s) decoding, {h.steps} steps; time outside ONNX Runtime's run over step time "
                f"(median step {h.step_ms:.3f} ms, host {h.host_us:.0f} us); feeds rebuilt every step: "
                f"{100.0 * old.share:.1f}% (host {old.host_us:.0f} us); {dims}; 1 ORT thread, wall time",
            }
        )
    return rows


if __name__ == "__main__":
    import sys

    print(format_table(run(quick="--quick" in sys.argv)))
