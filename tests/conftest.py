"""Suite-wide pytest setup: the `cuda` and `slow` markers skip cleanly where they cannot run.

Skips follow markers only (``item.get_closest_marker``), never keywords: a test parametrized with the value
``"cuda"`` or named ``..._slow`` runs like any other. Nothing else is skipped: a missing optional extra fails.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

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
    for item in items:
        if item.get_closest_marker("cuda") is not None and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="no CUDA device"))
        if item.get_closest_marker("slow") is not None and not slow:
            item.add_marker(pytest.mark.skip(reason="slow; set ORTPA_SLOW=1"))
