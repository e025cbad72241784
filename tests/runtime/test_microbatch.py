"""Several micro-batches in flight (``Engine(micro_batches=...)``): the engine's bookkeeping, without Ray.

The stages of a split toy LM run in threads here (:class:`ThreadedStages`: one thread per stage, each taking its
work from a FIFO queue, as a Ray actor runs the tasks one caller submits in order), so several steps really are in
flight and stage ``k`` computes one group's step while stage ``k - 1`` computes the next's; ONNX Runtime releases
the GIL while it runs. The reference is the unsplit model, each request alone (exact tokens): continuous
batching, chunked prefill, prefix caching, preemption and requests arriving mid-run must give every request the
tokens it gets alone. The same bookkeeping on a real Ray pipeline: tests/runtime/test_pipeline_ray.py.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortpa.errors import InvalidParameter, StageFailed
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.sampling import Sampler
from ortpa.runtime.scheduler import InvalidRequest, Request, RequestStatus, Scheduler
from ortpa.runtime.stage_chain import StageChain, StageRunner
from ortpa.stages import split_model
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

CPU = ["CPUExecutionProvider"]
BS = 4
CFG = ToyLMConfig(num_layers=4, seed=7)
LENGTHS = [(3, 9), (17, 5), (40, 12), (1, 7), (26, 4), (9, 10), (5, 6)]
PROMPTS = [[int(t) for t in np.random.default_rng(1).integers(0, CFG.vocab, size=n)] for n, _ in LENGTHS]
PARAMS = [SamplingParams(max_new_tokens=m) for _, m in LENGTHS]
WAIT_S = 60.0  # a stub step that takes longer is a bug in the stub or the engine (a few ms each)
STAGE_S = 0.004  # the least a stub stage's step takes (a sleep: the GIL is free), as a stage with real work


class ThreadedStages:
    """A :class:`StageChain`'s runners each in its own thread: the surface of
    :class:`~ortpa.runtime.pipeline.RayPipeline` the engine drives (``submit``, ``collect``, ``copy_blocks``,
    ``num_stages``). :meth:`fail_next` makes a stage lose its cache in its next step, as a killed actor does."""

    def __init__(self, chain: StageChain) -> None:
        self.chain = chain
        self.num_blocks, self.block_size = chain.num_blocks, chain.block_size
        self.num_stages = len(chain.runners)
        self.runners = list(chain.runners)
        self._queues: list[queue.Queue] = [queue.Queue() for _ in self.runners]
        self._fail: set[int] = set()
        self.busy = [0] * self.num_stages  # stages running a step right now
        self.most_busy = 0  # the most stages ever computing at once
        self._count = threading.Lock()
        self._threads = [threading.Thread(target=self._serve, args=(k,), daemon=True) for k in range(self.num_stages)]
        for t in self._threads:
            t.start()

    def submit(self, feeds) -> Future:
        done: Future = Future()
        self._queues[0].put(("step", feeds, {}, done))
        return done

    def collect(self, handle: Future) -> dict:
        return handle.result(timeout=WAIT_S)

    def run(self, feeds, output_names=None) -> dict:
        return self.collect(self.submit(feeds))

    def copy_blocks(self, pairs) -> None:
        pairs = list(pairs)
        if pairs:  # down the chain like a step: each stage copies after the steps submitted before
            self._queues[0].put(("copy", pairs, None, None))

    def fail_next(self, stage: int) -> None:
        self._fail.add(stage)

    def close(self) -> None:
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout=WAIT_S)

    def _serve(self, k: int) -> None:
        while (item := self._queues[k].get()) is not None:
            kind, feeds, received, done = item
            if kind == "copy":
                self.runners[k].copy_blocks(feeds)
            elif k in self._fail:  # a fresh runner, a fresh (zero) cache for its layers: as Ray's restart
                self._fail.discard(k)
                spec, chain = self.runners[k].spec, self.chain
                assert chain.manifest.folder is not None
                self.runners[k] = StageRunner(
                    chain.manifest.folder, spec, num_blocks=self.num_blocks, block_size=self.block_size, providers=CPU
                )
                done.set_exception(StageFailed(k, "killed by the test", True))
                continue
            elif not done.done():  # an earlier stage failed it: nothing to compute
                with self._count:
                    self.busy[k] = 1
                    self.most_busy = max(self.most_busy, sum(self.busy))
                try:
                    time.sleep(STAGE_S)
                    received = self.runners[k].step(feeds, received)
                except Exception as exc:
                    done.set_exception(exc)
                finally:
                    with self._count:
                        self.busy[k] = 0
            if k + 1 < self.num_stages:
                self._queues[k + 1].put((kind, feeds, received, done))
            elif kind == "step" and not done.done():
                done.set_result(received)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("toy") / "toy.onnx"
    onnx.save(build_toy_lm(CFG), path)
    return path


@pytest.fixture(scope="module")
def folders(toy, tmp_path_factory) -> dict[int, Path]:
    root = tmp_path_factory.mktemp("stages")
    return {n: split_model(toy, root / f"s{n}", n, verify=False).folder for n in (2, 3)}


@pytest.fixture(scope="module")
def alone(toy) -> list[list[int]]:
    """Each request alone through the unsplit model, no prefix caching: the reference."""
    engine = Engine(toy, num_blocks=96, block_size=BS, providers=CPU, enable_prefix_caching=False)
    return [engine.generate([p], s)[0] for p, s in zip(PROMPTS, PARAMS, strict=True)]


def _threaded(folder: Path, micro_batches: int, **kw) -> Engine:
    kw.setdefault("num_blocks", 96)
    engine = Engine(folder, block_size=BS, providers=CPU, stages="local", micro_batches=micro_batches, **kw)
    engine.session = ThreadedStages(engine.session)  # the in-process chain's stages, each in its own thread
    return engine


def _staggered(engine: Engine, arrivals: dict[int, list[int]]) -> list[list[int]]:
    """Add request i before step ``s`` for i in ``arrivals[s]``; step until all finish; outputs in order."""
    ids: dict[int, str] = {}
    out: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            ids[i] = engine.add_request(PROMPTS[i], PARAMS[i])
            out[ids[i]] = []
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    return [out[ids[i]] for i in sorted(ids)]


@pytest.mark.parametrize(("stages", "micro_batches"), [(2, 2), (3, 3), (3, 2)])
def test_micro_batches_give_each_request_its_tokens_alone(folders, alone, stages, micro_batches):
    # chunked prefill (16-token budget per group step) next to decodes, prompts of 1 to 40 tokens
    engine = _threaded(folders[stages], micro_batches, max_num_batched_tokens=16)
    try:
        assert engine.generate(PROMPTS, PARAMS) == alone
        assert engine.stats.max_in_flight == micro_batches
        assert engine.session.most_busy >= 2  # two stages computed at once: the steps overlapped
        assert engine.num_available_blocks == engine.num_blocks
    finally:
        engine.session.close()


def test_requests_arriving_mid_run_and_prefix_caching(folders, alone):
    engine = _threaded(folders[2], 2, max_num_batched_tokens=16)
    try:
        assert _staggered(engine, {0: [0, 1], 2: [2], 3: [3, 4], 7: [5, 6]}) == alone
        # the same prompts again: their full blocks come from the prefix cache, written by either group's steps
        before = engine.stats.cached_tokens
        assert _staggered(engine, {0: [0, 1, 2], 1: [3, 4, 5, 6]}) == alone
        assert engine.stats.cached_tokens > before
    finally:
        engine.session.close()


def test_preemption_inside_a_group_keeps_the_tokens(folders, alone):
    # 24 blocks of 4 tokens for 7 requests of up to 52 tokens: groups preempt their own newest requests
    engine = _threaded(folders[2], 2, num_blocks=24, max_num_batched_tokens=16)
    try:
        assert engine.generate(PROMPTS, PARAMS) == alone
        assert engine.stats.preemptions > 0
        assert engine.num_available_blocks == engine.num_blocks
    finally:
        engine.session.close()


def test_a_request_aborted_while_its_step_is_in_flight(folders, alone):
    # whole prompts in one step: the aborted request's step in flight would sample its first token
    engine = _threaded(folders[2], 2, max_num_batched_tokens=64)
    try:
        ids = [engine.add_request(p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)]
        out: dict[str, list[int]] = {i: [] for i in ids}
        for o in engine.step():  # group 0's first step landed, group 1's is in flight
            out[o.request_id].extend(o.new_token_ids)
        victim = ids[1]  # group 1 (least loaded when added: requests alternate groups)
        assert engine.scheduler.requests[victim].group == 1
        engine.abort(victim)
        while engine.has_unfinished():
            for o in engine.step():
                assert o.request_id != victim
                out[o.request_id].extend(o.new_token_ids)
        assert [out[i] for i in ids if i != victim] == [a for i, a in zip(ids, alone, strict=True) if i != victim]
        engine.step()  # the aborted request's last step in flight, if any, lands and is dropped
        assert engine.num_available_blocks == engine.num_blocks
    finally:
        engine.session.close()


def test_a_stage_failing_in_one_group_ends_every_request_with_a_cache(folders, alone):
    # two requests run at once (one per group), the others wait: those never had a cache and go on afterwards
    engine = _threaded(folders[3], 3, max_num_seqs=2, max_num_batched_tokens=64)
    try:
        ids = [engine.add_request(p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)]
        engine.step()
        engine.step()
        running = {r.request_id for r in engine.scheduler.running}
        assert len(running) == 2
        engine.session.fail_next(1)
        with pytest.raises(StageFailed, match="pipeline stage 1 failed"):
            for _ in range(4):
                engine.step()
        assert not engine.scheduler.running and not running & set(engine.scheduler.requests)
        assert len(engine.scheduler.requests) == len(PROMPTS) - 2  # the waiting ones
        out: dict[str, list[int]] = {i: [] for i in ids}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id].extend(o.new_token_ids)
        rest = [i for i in ids if i not in running]
        assert [out[i] for i in rest] == [alone[ids.index(i)] for i in rest]  # on the restarted stage's cache
        assert engine.num_available_blocks == engine.num_blocks
    finally:
        engine.session.close()


def test_groups_take_turns_in_one_process(toy, alone):
    """Without a pipeline (one model, steps run at once) several groups change nothing but the batches."""
    engine = Engine(toy, num_blocks=96, block_size=BS, providers=CPU, micro_batches=3, max_num_batched_tokens=16)
    assert engine.micro_batches == 3
    assert engine.generate(PROMPTS, PARAMS) == alone
    assert Engine(toy, num_blocks=8, block_size=BS, providers=CPU).micro_batches == 1
    with pytest.raises(InvalidParameter, match="micro_batches: expected an int >= 1"):
        Engine(toy, num_blocks=8, block_size=BS, providers=CPU, micro_batches=0)


def test_scheduler_groups_are_disjoint_and_balanced():
    kv = PagedKVCache(8, BS)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=8, num_groups=2)
    reqs = [Request(str(i), list(range(1, 9)), 8, Sampler(SamplingParams(max_new_tokens=4))) for i in range(3)]
    for r in reqs:
        sched.add(r)
    assert [r.group for r in reqs] == [0, 1, 0]  # the least loaded group, the lowest index among equals
    first = sched.schedule(0)
    assert {c.request.request_id for c in first.chunks} == {"0", "2"}
    # group 1's request needs 2 blocks; group 0 holds 4 of 8 and its steps may be in flight: it is not touched
    second = sched.schedule(1)
    assert [c.request.request_id for c in second.chunks] == ["1"] and not second.preempted
    # now the pool is full: group 1 may only preempt its own request, never group 0's (in flight)
    sched.commit(second.chunks)
    reqs[1].tokens += list(range(9))  # 9 more tokens: 3 more blocks, 2 are free
    third = sched.schedule(1)
    assert third.preempted == [reqs[1]] and not third.chunks
    assert reqs[0].status is reqs[2].status is RequestStatus.RUNNING
    sched.finish(reqs[0], RequestStatus.FINISHED_ABORTED)
    assert sched.group_load == [1, 1]
    with pytest.raises(InvalidRequest, match=r"expected a group in \[0, 2\), found 2"):
        sched.schedule(2)


def test_the_cli_flag_reaches_the_engine(folders, capsys):
    from ortpa.cli import main

    # refused before any stage starts (no Ray here): the value reached Engine(micro_batches=...)
    code = main(["generate", str(folders[2]), "--prompt-ids", "1,2", "--micro-batches", "0"])
    err = capsys.readouterr().err
    assert code != 0 and "micro_batches: expected an int >= 1" in err, (code, err)
