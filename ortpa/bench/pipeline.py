"""Pipeline stages on CPU: the cost of a hop between Ray actors and the pipeline bubble, N = 1, 2, 3 stages.

Model: the toy paged LM (``ortpa.testing.toy_lm``) at hidden 512, 8 heads (4 KV heads), 6 layers, vocab 2048,
split by ``ortpa split`` into N stages. Workload: a decode step of 16 sequences of 64 tokens (prefilled first),
repeated. Figures, all wall-clock ms per step, medians:

* ``in_process``: the stages run one after the other in this process (:class:`StageChain`); N = 1 is the
  unsplit model: what the split itself costs.
* ``ray_object_store``: each stage a Ray actor; the driver chains object references (the default of
  :class:`~ortpa.runtime.pipeline.RayPipeline`): shared inputs put once, each hidden state resolved by the next
  stage from the object store.
* ``ray_actor_handles``: each stage calls the next stage's actor itself with the hidden state.
* ``per_hop_ms``: (``ray_object_store`` - ``in_process``) / (N + 1): the messages of one step (driver -> stage 0,
  N - 1 hand-offs, the logits back).
* ``bubble``: 1 - (time the stages spent computing) / (N x wall time): the share of stage time idle, about
  (N - 1) / N with one step in flight.

Micro-batches, N = 2, 3: ``ortpa.Engine`` over the Ray stages generating 32 tokens for each of 16 prompts of 64
tokens (prefill included), with one step in flight (``micro_batches=1``) and with one per stage
(``micro_batches=N``, the default), both engines open and their runs alternating: ``tokens_per_s`` (median of
the runs), ``speedup`` (on / off) and ``busy_stage{k}``: the share of the run's wall time stage ``k`` spent in its
steps (wall time: a stage waiting for a core counts as busy). On a machine with fewer cores than stages plus the
driver the stages compete for cores, and overlapping them cannot pay.

Every stage runs ONNX Runtime with one intra-op thread, in process and in its actor alike. Ray runs locally with
six logical CPUs (two pipelines of three stages) and no dashboard; on a shared machine the figures move with the
load.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from ortpa.bench import format_table
from ortpa.bench._timing import median_ms, row
from ortpa.runtime.engine import Engine
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.sampling import SamplingParams
from ortpa.runtime.stage_chain import StageChain
from ortpa.stages import split_model
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

__all__ = ["run"]

CONFIG = ToyLMConfig(vocab=2048, hidden=512, num_heads=8, kv_heads=4, num_layers=6, max_positions=512)
BLOCK, NUM_BLOCKS, SEQS, PROMPT = 16, 256, 16, 64
NEW_TOKENS = 32  # generated per prompt in the micro-batch runs


def _one_thread():
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return options


def _decode_feeds(session) -> tuple[PagedKVCache, dict]:
    """Prefill SEQS prompts through ``session``, then the feeds of one decode step of all of them."""
    kv = PagedKVCache(NUM_BLOCKS, BLOCK)
    rng = np.random.default_rng(0)
    for s in range(SEQS):
        kv.add_sequence(s)
    plan = kv.plan_step([(s, PROMPT) for s in range(SEQS)])
    ids = rng.integers(0, CONFIG.vocab, size=SEQS * PROMPT).astype(np.int64)
    session.run(plan.model_feeds(ids, attention_metadata=True, position_ids=False), ["logits"])
    plan = kv.plan_step([(s, 1) for s in range(SEQS)])  # replayed: the same cache rows rewritten each time
    feeds = plan.model_feeds(rng.integers(0, CONFIG.vocab, size=SEQS).astype(np.int64), attention_metadata=True,
                             position_ids=False)  # fmt: skip
    return kv, feeds


def run(quick: bool = False) -> list[dict]:
    import ray

    from ortpa.runtime.pipeline import RayPipeline
    from ortpa.runtime.stage_folder import read_stage_folder

    repeats = 5 if quick else 40
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "toy.onnx"
        onnx.save(build_toy_lm(CONFIG), model)
        # logical CPUs for two pipelines of 3 stages at once (the micro-batch runs alternate two engines)
        ray.init(address="local", num_cpus=6, include_dashboard=False, log_to_driver=False)
        try:
            for n in (1, 2, 3):
                folder = split_model(model, Path(tmp) / f"s{n}", n, verify=False).folder
                manifest = read_stage_folder(folder)
                chain = StageChain(manifest, num_blocks=NUM_BLOCKS, block_size=BLOCK, sess_options=_one_thread())
                _, feeds = _decode_feeds(chain)
                local = median_ms(lambda c=chain, f=feeds: c.run(f), repeats)
                del chain
                pipe = RayPipeline(manifest, num_blocks=NUM_BLOCKS, block_size=BLOCK, threads=1)
                _decode_feeds(pipe)
                busy0 = sum(ray.get([a.busy.remote() for a in pipe.actors]))
                t0 = time.perf_counter()
                store = median_ms(lambda p=pipe, f=feeds: p.run(f), repeats)
                wall = time.perf_counter() - t0
                busy = sum(ray.get([a.busy.remote() for a in pipe.actors])) - busy0

                def handles(p=pipe, f=feeds):
                    ref = p.actors[0].step_forward.remote(ray.put(f), {}, p.actors[1:])
                    out = ray.get(ref)
                    while isinstance(out, ray.ObjectRef):
                        out = ray.get(out)
                    return out

                direct = median_ms(handles, repeats)
                pipe.close()
                note = f"{SEQS} sequences decoding, {CONFIG.num_layers} layers; machine shared"
                rows += [
                    {"name": f"N={n}", "metric": "in_process", "value": local, "unit": "ms/step", "notes": note},
                    {"name": f"N={n}", "metric": "ray_object_store", "value": store, "unit": "ms/step", "notes": ""},
                    {"name": f"N={n}", "metric": "ray_actor_handles", "value": direct, "unit": "ms/step", "notes": ""},
                    {
                        "name": f"N={n}",
                        "metric": "per_hop_ms",
                        "value": (store - local) / (n + 1),
                        "unit": "ms",
                        "notes": f"{n + 1} messages per step",
                    },
                    {
                        "name": f"N={n}",
                        "metric": "bubble",
                        "value": 1 - busy / (n * wall),
                        "unit": "fraction",
                        "notes": f"(N-1)/N = {(n - 1) / n:.2f} with one step in flight",
                    },
                ]
                if n > 1:
                    rows += _micro_batches(folder, n, 1 if quick else 5)
        finally:
            ray.shutdown()
    return rows


def _micro_batches(folder: Path, n: int, runs: int) -> list[dict]:
    """Engine throughput over ``n`` Ray stages with one step in flight and with one per stage; each stage's
    busy share of the wall time. Both engines are open at once and their runs alternate, so that a change in the
    machine's load falls on both."""
    import ray

    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(0, CONFIG.vocab, size=PROMPT)] for _ in range(SEQS)]
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    modes = (1, n)
    engines: dict[int, Engine] = {}
    walls: dict[int, list[float]] = {m: [] for m in modes}
    busy = {m: np.zeros(n) for m in modes}
    outputs: dict[int, list[list[int]]] = {}
    try:
        for micro in modes:
            engines[micro] = Engine(folder, num_blocks=NUM_BLOCKS, block_size=BLOCK, sess_options=_one_thread(),
                                    micro_batches=micro, enable_prefix_caching=False)  # fmt: skip
            engines[micro].generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))  # warm-up: first runs
        for _ in range(runs):
            for micro in modes:
                actors = engines[micro].session.actors
                before = np.array(ray.get([a.busy.remote() for a in actors]))
                t0 = time.perf_counter()
                outputs[micro] = engines[micro].generate(prompts, params)
                walls[micro].append(time.perf_counter() - t0)
                busy[micro] += (np.array(ray.get([a.busy.remote() for a in actors])) - before) / walls[micro][-1]
    finally:
        for engine in engines.values():
            engine.close()
    rows, rates = [], {}
    note = f"{SEQS} prompts of {PROMPT} tokens, {NEW_TOKENS} new each; median of {runs}; machine shared"
    for micro in modes:
        rates[micro] = sum(len(o) for o in outputs[micro]) / float(np.median(walls[micro]))
        label = f"N={n} micro_batches={micro}"
        rows.append(row(label, "tokens_per_s", rates[micro], "tokens/s", note))
        rows += [row(label, f"busy_stage{k}", b / runs, "fraction") for k, b in enumerate(busy[micro])]
    same = "same tokens" if outputs[1] == outputs[n] else "TOKENS DIFFER"
    rows.append(row(f"N={n}", "speedup", rates[n] / rates[1], "x", f"micro_batches={n} over 1; {same}"))
    return rows


if __name__ == "__main__":
    print(format_table(run()))
