"""Skips follow markers only: a test whose keywords say ``cuda`` / ``slow`` (a parameter value, a name) runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# The suite's own conftest, by path: `import conftest` may find another folder's (tests/ops/native has one).
_spec = importlib.util.spec_from_file_location("suite_conftest", Path(__file__).with_name("conftest.py"))
conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(conftest)


class _Item:
    """What the collection hook sees of a test item: its keywords, its markers, and ``add_marker``."""

    def __init__(self, keywords: set[str], markers: set[str]) -> None:
        self.keywords = dict.fromkeys(keywords, 1)
        self.markers = set(markers)
        self.skips: list[str] = []

    def get_closest_marker(self, name: str):
        return getattr(pytest.mark, name).mark if name in self.markers else None

    def add_marker(self, mark) -> None:
        self.skips.append(mark.mark.kwargs["reason"])


@pytest.fixture
def no_cuda_no_slow(monkeypatch):
    monkeypatch.delenv("ORTPA_SLOW", raising=False)
    monkeypatch.setattr(conftest, "_has_cuda", lambda: False)


def test_a_keyword_without_the_marker_is_not_skipped(no_cuda_no_slow, request):
    item = _Item({"test_x[cuda]", "cuda", "slow"}, markers=set())  # parametrized with "cuda", "slow"
    conftest.pytest_collection_modifyitems(request.config, [item])
    assert item.skips == []


def test_the_markers_skip(no_cuda_no_slow, request):
    item = _Item({"test_x", "cuda", "slow"}, markers={"cuda", "slow"})
    conftest.pytest_collection_modifyitems(request.config, [item])
    assert item.skips == ["no CUDA device", "slow; set ORTPA_SLOW=1"]
