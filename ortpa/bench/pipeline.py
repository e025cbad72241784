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

Every stage runs ONNX Runtime with one intra-op thread, in process and in its actor alike. Ray runs locally with
one logical CPU per stage and no dashboard; on a shared machine the figures move with the load.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from ortpa.bench import format_table
from ortpa.bench._timing import median_ms
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.stage_chain import StageChain
from ortpa.stages import split_model
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

__all__ = ["run"]

CONFIG = ToyLMConfig(vocab=2048, hidden=512, num_heads=8, kv_heads=4, num_layers=6, max_positions=512)
BLOCK, NUM_BLOCKS, SEQS, PROMPT = 16, 256, 16, 64


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
        ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
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
        finally:
            ray.shutdown()
    return rows


if __name__ == "__main__":
    print(format_table(run()))
