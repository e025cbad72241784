"""Helpers the benchmark modules share: a median step time, and a PagedAttention step with aliased caches."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np
import onnxruntime as ort

__all__ = [
    "aliased_step",
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
