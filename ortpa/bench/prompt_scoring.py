"""Prompt scoring (echo + log-probabilities) through the Engine: one pass over the prompt against one token per step.

Model (``ortpa.testing.dense_mla``, random weights, float32): hidden 512, 8 heads, kv_lora_rank 128, qk_nope 32,
qk_rope 16, v_head 32, 4 layers, vocab 4096, converted in memory with the default options (float16 caches by
``auto``). Workloads: 200-token random prompts, each ``prompt_logprobs=1`` and one generated token with
``logprobs=1`` (an ``echo`` completion with log-probabilities): one request alone, and 8 queued at once (quick:
4); steps of at most 256 tokens. Two engines over the same converted graph, one after the other in one run:

* ``one_pass``: the converted model as written: a step names the rows it needs (``logits_indices``), so a scored
  prompt prefills in chunks of the step budget;
* ``per_token``: the same graph with ``logits_indices`` made a constant (:func:`ortpa.testing.logits_rows.
  without_logits_indices`): the rows per sequence only, as every conversion was before that input, so the Engine
  scores a prompt one token per step.

Rows, per workload (``1x200``, ``8x200``): ``prompt_scoring/seconds/{one_pass,per_token}/...`` (CPU time of this
process, one ONNX Runtime thread: figures hold on a busy shared machine; the steps in the notes),
``prompt_scoring/speedup/...`` (per_token / one_pass; target >= 10 for one request) and
``prompt_scoring/max_abs_logprob_diff/...`` against ``ortpa.tolerances.logprob_bound`` of the cache dtype (the same
log-probabilities; ``tests/runtime/test_prompt_scoring.py`` asserts it against the dense model). With 8 prompts
the one-token steps carry 8 rows each, so every read of the weights serves 8 tokens; on one CPU thread the one
pass is then compute-bound and the ratio is smaller (it is the step count, 200 against 7, that a GPU pays for).
"""

from __future__ import annotations

import os
import time

import numpy as np
import onnx
import onnxruntime as ort

from ortpa.bench._timing import row
from ortpa.bench.runner import format_table
from ortpa.providers import CPU
from ortpa.rewriter.pipeline import convert
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.testing.dense_mla import DenseMlaConfig, build_dense_mla, dense_mla_weights
from ortpa.testing.logits_rows import without_logits_indices
from ortpa.tolerances import logprob_bound

__all__ = ["run"]

CONFIG = DenseMlaConfig(
    hidden=512, layers=4, heads=8, q_lora_rank=None, kv_lora_rank=128, qk_nope=32, qk_rope=16, v_head=32,
    vocab=4096, intermediate=1024, max_position_embeddings=512,
)  # fmt: skip
PROMPT_LEN, BUDGET, BLOCK = 200, 256, 16


def _engine(model: onnx.ModelProto, prompts: int) -> Engine:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1  # CPU time of one thread: stable under a shared machine's load
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    blocks = prompts * (PROMPT_LEN // BLOCK + 2) + 4
    return Engine(
        model,
        num_blocks=blocks,
        block_size=BLOCK,
        providers=[CPU],
        max_num_batched_tokens=BUDGET,
        enable_prefix_caching=False,
        sess_options=opts,
    )


def _score(engine: Engine, prompts: list[list[int]]) -> tuple[float, int, list[np.ndarray]]:
    """(CPU seconds, steps, each prompt's log-probabilities then its generated token's) of one run."""
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=1, logprobs=1)
    ids = [engine.add_request(p, params) for p in prompts]
    got: dict[str, list[float]] = {i: [] for i in ids}
    steps = 0
    t0 = time.process_time()
    while engine.has_unfinished():
        steps += 1
        for o in engine.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] += [lp.logprob for lp in o.prompt_logprobs[1:]]
            if o.logprobs:
                got[o.request_id] += [lp.logprob for lp in o.logprobs]
    seconds = time.process_time() - t0
    return seconds, steps, [np.array(got[i]) for i in ids]


def _scenario(model: onnx.ModelProto, before: onnx.ModelProto, n: int, cache: str) -> list[dict]:
    rng = np.random.default_rng(n)
    prompts = [[int(t) for t in rng.integers(0, CONFIG.vocab, PROMPT_LEN)] for _ in range(n)]
    results = {}
    for name, graph in (("one_pass", model), ("per_token", before)):
        engine = _engine(graph, n)
        _score(engine, [prompts[0][:40]])  # first-run allocations and kernel selection are not scoring
        results[name] = _score(engine, prompts)
    (t_new, steps_new, new), (t_old, steps_old, old) = results["one_pass"], results["per_token"]
    diff = max(float(np.max(np.abs(a - b))) for a, b in zip(new, old, strict=True))
    at = f"{n}x{PROMPT_LEN}"
    return [
        row(f"prompt_scoring/seconds/one_pass/{at}", "cpu_seconds", t_new, "s", f"{steps_new} steps"),
        row(f"prompt_scoring/seconds/per_token/{at}", "cpu_seconds", t_old, "s", f"{steps_old} steps"),
        row(f"prompt_scoring/speedup/{at}", "per_token / one_pass", t_old / t_new, "x", _TARGETS[n > 1]),
        row(
            f"prompt_scoring/max_abs_logprob_diff/{at}",
            "max |d logprob|",
            diff,
            "nats",
            f"bound {logprob_bound(cache):.3g} ({cache} caches)",
        ),
    ]


_TARGETS = {
    False: "target >= 10 (one echo request)",
    True: "measured (no target): one-token steps of n prompts share each read of the weights",
}


def run(quick: bool = False) -> list[dict]:
    model = convert(build_dense_mla(CONFIG, dense_mla_weights(CONFIG)), providers=())
    cache = {p.key: p.value for p in model.metadata_props}.get("ortpa.kv_cache_dtype", "float16")
    before = without_logits_indices(model)
    env = f"{os.cpu_count()} cpus, 1 ORT thread, CPU time, steps of <= {BUDGET} tokens"
    dims = f"dense MLA hidden {CONFIG.hidden}, {CONFIG.layers} layers, vocab {CONFIG.vocab}; {env}"
    rows = [row("prompt_scoring/model", "parameters", _parameters(model), "", dims)]
    for n in (1, 4 if quick else 8):
        rows += _scenario(model, before, n, cache)
    return rows


def _parameters(model: onnx.ModelProto) -> int:
    return sum(int(np.prod(t.dims)) for t in model.graph.initializer if len(t.dims) > 1)


if __name__ == "__main__":
    print(format_table(run(quick=False)))
