"""Helpers the benchmark modules share: a median step time, and a PagedAttention step with aliased caches."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

__all__ = [
    "DecodeHost",
    "aliased_step",
    "decode_host_share",
    "engine_tokens_per_s",
    "interleaved_ms",
    "median_ms",
    "row",
]

_CACHES = (("key_cache", "key_cache_out"), ("value_cache", "value_cache_out"))


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` in ms over ``repeats`` runs, after one untimed warm-up run."""
    fn()  # warm-up: first-run allocations and kernel selection are not part of a step
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def interleaved_ms(fns: Mapping[str, Callable[[], object]], repeats: int, clock=time.perf_counter) -> dict:
    """Median ms of each callable, run round-robin after one warm-up each (a burst of outside load then hits
    every one alike); ``clock`` may be ``time.process_time`` (CPU time of this process)."""
    for fn in fns.values():
        fn()
    times: dict = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = clock()
            fn()
            times[k].append(clock() - t0)
    return {k: 1e3 * float(np.median(v)) for k, v in times.items()}


def aliased_step(sess: ort.InferenceSession, x: Mapping[str, np.ndarray], *, alias: bool = True):
    """A callable running one step of a one-node PagedAttention session on ``x``; with ``alias`` each cache
    input and its ``*_out`` output are bound to one OrtValue (updated in place), else the outputs are fresh."""
    io = sess.io_binding()
    caches = {}
    for name, a in x.items():
        if name in ("key_cache", "value_cache"):
            caches[name] = ort.OrtValue.ortvalue_from_numpy(a)
            io.bind_ortvalue_input(name, caches[name])
        else:
            io.bind_cpu_input(name, a)
    io.bind_output("output")
    for src, out in _CACHES:
        if src in caches:
            if alias:
                io.bind_ortvalue_output(out, caches[src])
            else:
                io.bind_output(out)
    return lambda: sess.run_with_iobinding(io)


def row(name: str, metric: str, value: float, unit: str, notes: str = "") -> dict:
    """One benchmark row, as ``ortpa bench`` prints it."""
    return {"name": name, "metric": metric, "value": round(float(value), 6), "unit": unit, "notes": notes}


def engine_tokens_per_s(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Generated tokens per second of ``engine.generate(prompts)`` (greedy, ``new_tokens`` each, all submitted at
    once), after a one-prompt warm-up run."""
    from ortpa.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens)
    engine.generate(prompts[:1], params)  # warm-up: first-run allocations and kernel selection
    t = time.perf_counter()
    out = engine.generate(prompts, params)
    return sum(len(o) for o in out) / (time.perf_counter() - t)


@dataclass(frozen=True)
class DecodeHost:
    """Where the wall time of an engine's decode steps goes: ONNX Runtime's run, and everything else (host)."""

    steps: int
    step_ms: float  # median wall time of one decode step
    host_us: float  # median time of one step outside ONNX Runtime's run: index tensors, sampling, Python
    share: float  # host time over step time, summed over the steps


def decode_host_share(engine, prompts: list[list[int]], new_tokens: int) -> DecodeHost:
    """Host time of ``engine``'s decode steps: the prompts are added and prefilled, then every step (all decodes)
    is timed, and inside it the time ONNX Runtime's ``run_with_iobinding`` takes. The rest of the step is the
    driver loop: scheduling, the index tensors, binding, sampling and the Python between runs.

    Needs an engine over a model file (its session is one ONNX Runtime session); the engine's ORT session gets a
    timing wrapper for the call's duration.
    """
    from ortpa.runtime.sampling import SamplingParams

    ort_session = engine.session.session._sess
    inner = ort_session.run_with_iobinding
    in_run = [0.0]

    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            in_run[0] += time.perf_counter() - t

    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4))  # warm-up
    ort_session.run_with_iobinding = timed
    try:
        for p in prompts:
            engine.add_request(p, SamplingParams(max_new_tokens=new_tokens))
        while engine.scheduler.waiting or any(not r.is_decoding for r in engine.scheduler.running):
            engine.step()
        steps, hosts = [], []
        while engine.has_unfinished():
            in_run[0] = 0.0
            t = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t)
            hosts.append(steps[-1] - in_run[0])
    finally:
        del ort_session.run_with_iobinding  # the class's method again
    return DecodeHost(
        len(steps), 1e3 * float(np.median(steps)), 1e6 * float(np.median(hosts)), sum(hosts) / max(sum(steps), 1e-12)
    )
