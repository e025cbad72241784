"""Suite-wide pytest setup: the `cuda`, `slow` and `compat` markers skip cleanly where they cannot run.

Skips follow markers only (``item.get_closest_marker``), never keywords: a test parametrized with the value
``"cuda"`` or named ``..._slow`` runs like any other. Nothing else is skipped: a missing optional extra fails.

Under pytest-xdist with more than one worker, each worker computes on one thread: N workers on N cores that
each start ONNX Runtime's and torch's default thread pools (one thread per core, spinning while idle) run slower
than N single-threaded workers. Set here, before any test imports torch or opens a session.
"""

from __future__ import annotations

import functools
import os

import pytest
from hypothesis import HealthCheck, settings

_PARALLEL_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1


def _one_thread_per_worker() -> None:
    """torch (and any OpenMP/BLAS pool, also in subprocesses the tests start) and every ONNX Runtime session this
    process opens: one intra-op thread. A session's explicit thread count above one is lowered too: the tests that
    ask for two threads ask it for speed on an otherwise idle machine, which a parallel run is not."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    import onnxruntime as ort

    init = ort.InferenceSession.__init__

    @functools.wraps(init)
    def one_thread_init(self, path_or_bytes, sess_options=None, *args, **kwargs):
        if sess_options is None:
            sess_options = ort.SessionOptions()
        if sess_options.intra_op_num_threads != 1:
            sess_options.intra_op_num_threads = 1
        init(self, path_or_bytes, sess_options, *args, **kwargs)

    ort.InferenceSession.__init__ = one_thread_init


if _PARALLEL_WORKERS and os.environ.get("ORTPA_TEST_THREADS") != "default":
    _one_thread_per_worker()


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: two single-threaded workers per core the process may run on. Much of the suite waits rather
    than computes (servers starting, subprocesses, genai's venv), and a second worker per core fills that wait:
    measured on 2 cores, 7:01 with four workers against 11:30 with two."""
    return 2 * len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2 * (os.cpu_count() or 1)


settings.register_profile(
    "ci", max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("slow", max_examples=2000, deadline=None, derandomize=False)
settings.load_profile("slow" if os.environ.get("ORTPA_SLOW") == "1" else "ci")


def _has_cuda() -> bool:
    from ortpa.runtime.device import has_cuda

    return has_cuda()


def pytest_collection_modifyitems(config, items):
    has_cuda = _has_cuda()
    slow = os.environ.get("ORTPA_SLOW") == "1"
    compat = os.environ.get("ORTPA_COMPAT") == "1"
    for item in items:
        if item.get_closest_marker("cuda") is not None and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))
        if item.get_closest_marker("slow") is not None and not slow:
            item.add_marker(pytest.mark.skip(reason="slow; set ORTPA_SLOW=1"))
        if item.get_closest_marker("compat") is not None and not compat:
            item.add_marker(pytest.mark.skip(reason="compat matrix; set ORTPA_COMPAT=1"))
