"""A stage folder run by the Engine with each stage a Ray actor, on a local two-node Ray cluster.

One cluster for the module (``ray.cluster_utils.Cluster``: a head and a second node, 2 logical CPUs each, no
dashboard), one engine per folder: Ray's start-up is the cost here, not the tiny models. The reference is the
unsplit model run by the same Engine in this process (exact tokens). The engines keep one micro-batch per stage
in flight (the default): the stages' steps must overlap. Killing a stage's process mid-stream must fail the
stream within seconds and leave an engine that serves new requests with the same tokens.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
import ray

from ortpa.errors import StageFailed
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.stages import split_model
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

CPU = ["CPUExecutionProvider"]
BS = 4
LENGTHS = [(3, 9), (17, 5), (40, 12), (1, 7), (26, 4)]
PARAMS = [SamplingParams(max_new_tokens=m) for _, m in LENGTHS]
PROMPTS = [[int(t) for t in np.random.default_rng(0).integers(0, 64, size=n)] for n, _ in LENGTHS]


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    c.add_node(num_cpus=2)
    ray.init(address=c.address, include_dashboard=False, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("toy") / "toy.onnx"
    onnx.save(build_toy_lm(ToyLMConfig(num_layers=4, seed=5)), path)
    return path


@pytest.fixture(scope="module")
def reference(toy) -> list[list[int]]:
    engine = Engine(toy, num_blocks=96, block_size=BS, providers=CPU, enable_prefix_caching=False)
    return [engine.generate([p], s)[0] for p, s in zip(PROMPTS, PARAMS, strict=True)]


@pytest.fixture(scope="module")
def two_stages(toy, tmp_path_factory) -> Path:
    return split_model(toy, tmp_path_factory.mktemp("s2") / "stages", 2, verify=False).folder


def test_stages_on_two_nodes_give_the_unsplit_tokens(cluster, toy, two_stages, reference):
    engine = Engine(two_stages, num_blocks=96, block_size=BS, placement="strict-spread", max_num_batched_tokens=16)
    try:
        placed = engine.session.placed
        assert len({p["node"] for p in placed}) == 2, f"expected one stage per node, found {placed}"
        assert engine.generate(PROMPTS, PARAMS) == reference  # batched (chunked prefill mixes with decodes)
        # one micro-batch per stage by default, both in flight: stage 0 began a step before stage 1 had finished the
        # one before it (with one step in flight, stage 0 waits for the logits of the step before)
        assert engine.micro_batches == 2 and engine.stats.max_in_flight == 2
        first, second = ray.get([a.step_spans.remote() for a in engine.session.actors])
        assert len(first) == len(second) == engine.stats.steps
        assert any(first[i + 1][0] < second[i][1] for i in range(len(first) - 1)), (first, second)
        # staggered arrivals: decodes of the first requests share steps with the later prompts
        ids, out, step = {}, {}, 0
        while step < len(PROMPTS) or engine.has_unfinished():
            if step < len(PROMPTS):
                ids[step] = engine.add_request(PROMPTS[step], PARAMS[step])
                out[ids[step]] = []
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
            step += 1
        assert [out[ids[i]] for i in range(len(PROMPTS))] == reference
        # each stage process allocated the caches of its own layers only (key and value, float16)
        cfg = ToyLMConfig()
        for spec, m in zip(engine.session.manifest.stages, engine.session.memory(), strict=True):
            layers = spec.stop_layer - spec.first_layer
            assert m["cache"] == layers * 2 * 96 * BS * cfg.kv_heads * cfg.head_size * 2
            assert m["rss"] >= m["private"] > 0
    finally:
        engine.close()


def test_three_stages_and_a_killed_stage(cluster, toy, reference, tmp_path):
    folder = split_model(toy, tmp_path / "s3", 3, verify=False).folder
    engine = Engine(folder, num_blocks=96, block_size=BS)
    try:
        assert engine.generate(PROMPTS, PARAMS) == reference
        long = SamplingParams(max_new_tokens=60)
        seen = 0
        with pytest.raises(StageFailed, match="pipeline stage 1 failed: its process died") as info:
            for _ in engine.stream(PROMPTS[:3], long):
                seen += 1
                if seen == 6:
                    os.kill(engine.session.placed[1]["pid"], signal.SIGKILL)
                    killed = time.perf_counter()
        assert time.perf_counter() - killed < 30  # Ray reports the death in seconds; restart included
        assert info.value.restarted and info.value.stage == 1
        assert not engine.has_unfinished()  # nothing continues on the lost cache
        assert engine.num_available_blocks == engine.num_blocks
        assert engine.generate(PROMPTS, PARAMS) == reference  # the restarted stage serves new requests
    finally:
        engine.close()


@pytest.mark.slow
def test_each_stage_process_holds_its_share_of_the_weights(cluster, tmp_path):
    """Private memory of each stage process after a step, above the same stage of a tiny model (the Python, Ray
    and ONNX Runtime baseline): at most its own weights and cache, and the stages together about the unsplit
    model's process. About 60 s on 2 cores."""
    big = ToyLMConfig(vocab=16384, hidden=512, num_heads=8, kv_heads=4, num_layers=6, max_positions=256)
    slack = 8 << 20  # allocator arenas, the larger model's activations
    grown: dict[int, list[int]] = {}
    for n in (1, 2, 3):
        private = {}
        for name, cfg in (("tiny", ToyLMConfig(num_layers=6)), ("big", big)):
            model = tmp_path / f"{name}.onnx"
            if not model.exists():
                onnx.save(build_toy_lm(cfg), model, save_as_external_data=True, location=f"{name}.data")
            folder = split_model(model, tmp_path / f"{name}{n}", n, verify=False).folder
            engine = Engine(folder, num_blocks=64, block_size=16)
            try:
                engine.generate([list(range(64))], SamplingParams(max_new_tokens=2))
                private[name] = engine.session.memory()
                specs = engine.session.manifest.stages
            finally:
                engine.close()
        grown[n] = [b["private"] - t["private"] for b, t in zip(private["big"], private["tiny"], strict=True)]
        for spec, extra, mem in zip(specs, grown[n], private["big"], strict=True):
            assert extra <= spec.weight_bytes + mem["cache"] + slack, (n, spec.index, extra, spec.weight_bytes)
    for n in (2, 3):
        assert sum(grown[n]) <= 1.2 * sum(grown[1]) + n * slack, grown
