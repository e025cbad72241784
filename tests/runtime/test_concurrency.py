"""Threads: one InferenceSession from many threads, a PagedSession's serialized steps, one Engine driven by one
thread while others add and abort, a second driver refused, and two engines that never share a cache buffer.

Decision (see ortpa/runtime/engine.py and session.py): ``InferenceSession.run`` is safe and parallel;
``PagedSession`` calls are safe and serialized by a lock (one mutable cache buffer); an ``Engine`` has one
driver thread (a second concurrent ``step``/``generate`` raises ``ConcurrentUse``) while ``add_request`` /
``abort`` are safe from any thread; every engine owns its own pool, so two engines cannot share one.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from ortpa.errors import ConcurrentUse
from ortpa.ops.portable import paged_attention_model
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.runtime.scheduler import RequestStatus
from ortpa.runtime.session import InferenceSession, PagedSession
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

CPU = ["CPUExecutionProvider"]
CFG = ToyLMConfig(vocab=32, hidden=32, num_heads=2, kv_heads=1, num_layers=2, max_positions=128)
MODEL = build_toy_lm(CFG)
BS = 4
THREADS = 6


def _prompt(rng, n):
    return [int(t) for t in rng.integers(0, CFG.vocab, size=n)]


# -- InferenceSession: concurrent run ----------------------------------------------------------------------
NH, KVH, H, NB = 4, 2, 16, 8


def _node_inputs(seed, dtype):
    rng = np.random.default_rng(seed)
    q_lens, past = [int(rng.integers(1, 6)), 1], [int(rng.integers(0, 20)), int(rng.integers(0, 40))]
    t = sum(q_lens)
    cu = np.array([0, q_lens[0], t], np.int32)
    table = rng.permutation(NB)[:6].reshape(2, 3).astype(np.int32)
    return {
        "query": rng.standard_normal((t, NH * H)).astype(dtype),
        "key": rng.standard_normal((t, KVH * H)).astype(dtype),
        "value": rng.standard_normal((t, KVH * H)).astype(dtype),
        "key_cache": rng.standard_normal((NB, 16, KVH, H)).astype(dtype),
        "value_cache": rng.standard_normal((NB, 16, KVH, H)).astype(dtype),
        "cumulative_sequence_length": cu,
        "past_seqlens": np.asarray(past, np.int32),
        "block_table": table,
    }


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16-plain-run", "bf16-bound-run"])
def test_inference_session_run_from_threads_equals_serial(dtype):
    feeds = [_node_inputs(seed, dtype) for seed in range(48)]
    sess = InferenceSession(paged_attention_model(feeds[0], {"num_heads": NH, "kv_num_heads": KVH}), providers=CPU)
    serial = [sess.run(None, f) for f in feeds]
    before = [{k: v.copy() for k, v in f.items()} for f in feeds]
    for _ in range(3):  # a few rounds: races are probabilistic
        with ThreadPoolExecutor(THREADS) as pool:
            threaded = list(pool.map(lambda f: sess.run(None, f), feeds))
        for i, (got, ref) in enumerate(zip(threaded, serial, strict=True)):
            for g, r in zip(got, ref, strict=True):
                np.testing.assert_array_equal(g.view(np.uint8), r.view(np.uint8), err_msg=f"feed {i}")
    for f, b in zip(feeds, before, strict=True):  # nobody's inputs were written
        for k in f:
            np.testing.assert_array_equal(f[k].view(np.uint8), b[k].view(np.uint8), err_msg=k)


# -- PagedSession: safe, one call at a time ------------------------------------------------------------------
class _CountingSession:
    """Stands in for the ORT session inside a PagedSession; records how many runs overlap."""

    def __init__(self, sess):
        self._sess = sess
        self._mu = threading.Lock()
        self.active = self.max_active = 0

    def io_binding(self):
        return self._sess.io_binding()

    def run_with_iobinding(self, io, run_options=None):
        with self._mu:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        try:
            time.sleep(0.002)  # widen the window in which an unserialized second call would overlap
            return self._sess.run_with_iobinding(io, run_options)
        finally:
            with self._mu:
                self.active -= 1


def _greedy_on_blocks(paged: PagedSession, prompt, blocks, steps):
    """Greedy decode of one sequence on fixed blocks (its own range of the pool), one run per token."""
    out, past, new = [], 0, list(prompt)
    table = np.array([blocks], np.int32)
    for _ in range(steps):
        n = len(new)
        logits = paged.run(
            {
                "input_ids": np.array(new, np.int64),
                "cumulative_sequence_lengths": np.array([0, n], np.int32),
                "past_sequence_lengths": np.array([past], np.int32),
                "block_table": table,
                "attention_metadata": np.array([n, past + n, past + n], np.int32),
            }
        )["logits"]
        past += n
        new = [int(logits[0].argmax())]
        out.append(new[0])
    return out


def test_paged_session_calls_from_threads_are_serialized_and_equal_serial():
    rng = np.random.default_rng(1)
    per = 6  # blocks per thread: up to 24 tokens
    prompts = [_prompt(rng, int(rng.integers(1, 10))) for _ in range(THREADS)]
    blocks = [list(range(k * per, (k + 1) * per)) for k in range(THREADS)]
    ref = PagedSession(MODEL, num_blocks=THREADS * per, block_size=BS, providers=CPU)
    serial = [_greedy_on_blocks(ref, p, b, 12) for p, b in zip(prompts, blocks, strict=True)]

    paged = PagedSession(MODEL, num_blocks=THREADS * per, block_size=BS, providers=CPU)
    counter = _CountingSession(paged.session._sess)
    paged.session._sess = counter
    with ThreadPoolExecutor(THREADS) as pool:
        jobs = [pool.submit(_greedy_on_blocks, paged, p, b, 12) for p, b in zip(prompts, blocks, strict=True)]
        # block copies and cache reads from yet another thread, on blocks nobody uses, interleave safely
        spare = paged.num_blocks - 1
        for _ in range(20):
            paged.copy_blocks([(spare, spare)])
            paged.cache(paged.cache_names[0])
        threaded = [j.result() for j in jobs]
    assert threaded == serial
    assert counter.max_active == 1, f"{counter.max_active} PagedSession runs overlapped on one cache buffer"


# -- Engine: one driver, requests from anywhere --------------------------------------------------------------
def _engine(**kw):
    kw.setdefault("num_blocks", 40)
    return Engine(MODEL, block_size=BS, providers=CPU, max_num_batched_tokens=32, **kw)


def _alone(prompts, params):
    engine = _engine(num_blocks=64, enable_prefix_caching=False)
    return [engine.generate([p], s)[0] for p, s in zip(prompts, params, strict=True)]


def test_add_and_abort_from_other_threads_while_one_thread_steps():
    rng = np.random.default_rng(2)
    n = 60
    prompts = [_prompt(rng, int(rng.integers(1, 14))) for _ in range(n)]
    params = [SamplingParams(max_new_tokens=int(rng.integers(2, 12))) for _ in range(n)]
    alone = _alone(prompts, params)
    engine = _engine(num_blocks=20)  # small: preemption happens while others add and abort
    ids: dict[int, str] = {}
    aborted: set[int] = set()
    outputs: dict[str, list[int]] = {}
    mu = threading.Lock()
    producers_done = threading.Event()

    def produce(k):
        for i in range(k, n, 3):
            rid = engine.add_request(prompts[i], params[i], request_id=f"r{i}")
            with mu:
                ids[i] = rid
                outputs[rid] = []
            time.sleep(0.001)

    def abort_some():
        # abort every 7th request once it is running, so the abort usually lands while a step computes it
        for i in range(0, n, 7):
            while i not in ids:
                time.sleep(0.0005)
            while (r := engine.scheduler.requests.get(ids[i])) is not None and r.status is RequestStatus.WAITING:
                time.sleep(0.0002)
            try:
                engine.abort(ids[i])
                aborted.add(i)
            except KeyError:  # UnknownRequest: it had already finished
                pass

    threads = [threading.Thread(target=produce, args=(k,), daemon=True) for k in range(3)]
    threads.append(threading.Thread(target=abort_some, daemon=True))
    for t in threads:
        t.start()
    watcher = threading.Thread(target=lambda: ([t.join() for t in threads], producers_done.set()), daemon=True)
    watcher.start()
    while not producers_done.is_set() or engine.has_unfinished():
        for out in engine.step():
            with mu:
                outputs[out.request_id].extend(out.new_token_ids)
        engine.kv.check_invariants()
    watcher.join()
    assert len(ids) == n
    for i in range(n):
        got = outputs[ids[i]]
        if i in aborted:
            assert got == alone[i][: len(got)], f"aborted request {i}"
        else:
            assert got == alone[i], f"request {i}: {got} vs alone {alone[i]}"
    assert engine.num_available_blocks == engine.num_blocks
    engine.reset_prefix_cache()
    assert engine.kv.num_free_blocks == engine.num_blocks and len(engine.kv) == 0


def _block_session_run(engine):
    """Make the engine's next model run wait until released; returns (entered, release) events."""
    entered, release = threading.Event(), threading.Event()
    run = engine.session.run

    def slow_run(*a, **kw):
        entered.set()
        assert release.wait(30)
        return run(*a, **kw)

    engine.session.run = slow_run
    return entered, release


@pytest.mark.parametrize("second", ["step", "generate"])
def test_a_second_driver_thread_is_refused(second):
    engine = _engine()
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=3))
    entered, release = _block_session_run(engine)
    first = threading.Thread(target=engine.step, name="driver-A")
    first.start()
    assert entered.wait(30)
    adder = threading.Thread(target=engine.add_request, args=([7, 8], SamplingParams(max_new_tokens=2), "late"))
    try:
        with pytest.raises(ConcurrentUse, match=r"Engine\.step is already in use by thread 'driver-A'"):
            engine.step() if second == "step" else engine.generate([[4, 5]], SamplingParams(max_new_tokens=2))
        adder.start()  # other threads may still add: the request waits for the running step, then is queued
        adder.join(0.3)
        assert adder.is_alive(), "add_request changed the scheduler in the middle of a step"
    finally:
        release.set()
        first.join(30)
        adder.join(30)
    assert "late" in engine.scheduler.requests
    while engine.has_unfinished():  # the refused thread can drive once the first is done
        engine.step()
    assert engine.num_available_blocks == engine.num_blocks


def test_generate_returns_when_another_thread_aborts_its_request():
    prompt, params = [3, 1, 4, 1, 5], SamplingParams(max_new_tokens=60)
    (alone,) = _alone([prompt], [params])
    engine = _engine()
    calls, started = [0], threading.Event()

    def counting(run):
        def counting_run(*a, **kw):
            calls[0] += 1
            if calls[0] == 5:
                started.set()
            return run(*a, **kw)

        return counting_run

    # steps run the session's run (a prompt) or run_bound (decodes on the bound feeds)
    engine.session.run = counting(engine.session.run)
    engine.session.run_bound = counting(engine.session.run_bound)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(engine.generate([prompt], params)), daemon=True)
    worker.start()
    assert started.wait(30)
    engine.abort("0")
    worker.join(30)
    assert not worker.is_alive(), "generate() kept waiting for a request aborted from another thread"
    (got,) = result[0]
    assert 0 < len(got) < 60 and got == alone[: len(got)]
    assert engine.num_available_blocks == engine.num_blocks


# -- two engines: never one pool -----------------------------------------------------------------------------
def test_two_engines_on_one_model_own_separate_pools_and_run_in_parallel():
    rng = np.random.default_rng(3)
    prompts = [_prompt(rng, int(rng.integers(1, 12))) for _ in range(8)]
    params = [SamplingParams(max_new_tokens=8)] * 8
    alone = _alone(prompts, params)
    a, b = _engine(), _engine()
    ptrs_a, ptrs_b = a.session.data_ptrs(), b.session.data_ptrs()
    assert set(ptrs_a.values()).isdisjoint(ptrs_b.values()), "two engines share a cache buffer"
    for name in a.session.cache_names:
        assert not np.shares_memory(a.session._arrays[name], b.session._arrays[name]), name
    assert a.kv is not b.kv and a.kv.pool is not b.kv.pool
    with ThreadPoolExecutor(2) as pool:  # each engine driven by its own thread, at the same time
        fa = pool.submit(a.generate, prompts, params)
        fb = pool.submit(b.generate, prompts[::-1], params)
        got_a, got_b = fa.result(), fb.result()
    assert got_a == alone and got_b == alone[::-1]
    assert a.session.data_ptrs() == ptrs_a and b.session.data_ptrs() == ptrs_b
