"""Several micro-batches in flight: the steps the :class:`~ortpa.runtime.engine.Engine` has launched and not yet
landed.

With pipeline stages, one step at a time leaves every stage idle while the others run (the bubble,
``(N - 1) / N``). The engine instead splits its requests into groups (``Scheduler(num_groups=...)``, each request in
one group for its life) and keeps up to one step of every group submitted: while stage ``k`` runs group ``g``'s
step, stage ``k - 1`` runs group ``g + 1``'s. A group is scheduled again only once its previous step has landed
(its tokens sampled), so a step never depends on one still in flight, and steps land in the order they were
launched (every stage runs its steps in submission order).

:class:`Launched` is one step between its launch and its landing; :class:`InFlight` the queue of them, which says
which group to launch next (round robin over the groups not in flight) and how deep the queue got.
:func:`submit` / :func:`collect` hand a step to the model: an executor with ``submit`` / ``collect`` (a
:class:`~ortpa.runtime.pipeline.RayPipeline`) runs it in the background; any other session (one model, stages
in this process) runs it at once, so groups take turns there and only the bookkeeping is exercised.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ortpa.runtime.prompt_scoring import StepRows
from ortpa.runtime.scheduler import ScheduledChunk

__all__ = ["InFlight", "Launched", "Ran", "collect", "submit"]


@dataclass
class Launched:
    """One group's step, submitted to the model: what landing it needs."""

    group: int
    chunks: list[ScheduledChunk]
    num_ids: int  # tokens packed into the step (a model giving a row per token is told apart by this)
    asked: StepRows | None  # the logits rows the step asked for; None: one per chunk (an all-decode bound step)
    handle: Any  # from submit(): the executor's handle, or the outputs of a step already run


@dataclass(frozen=True)
class Ran:
    """A step already run (by a session without ``submit``, or the engine's all-decode path): its outputs."""

    outputs: Mapping[str, np.ndarray]


def submit(session: Any, feeds: Mapping[str, Any]) -> Any:
    """Start one step on ``session``: in the background where it can (``session.submit``), else run it now."""
    start = getattr(session, "submit", None)
    if start is None:
        return Ran(session.run(feeds, ["logits"]))
    return start(feeds)


def collect(session: Any, handle: Any) -> np.ndarray:
    """The logits of a step :func:`submit` started, waiting for it if it still runs."""
    outputs = handle.outputs if isinstance(handle, Ran) else session.collect(handle)
    return outputs["logits"]


class InFlight:
    """Steps launched and not landed, oldest first: at most one per group, at most ``depth`` in all."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._steps: collections.deque[Launched] = collections.deque()
        self._next = 0  # the group after the one launched last: round robin keeps every group's pace
        self.max_depth = 0  # the most steps ever in flight at once (tests and the bench read it)

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self) -> Iterator[Launched]:
        return iter(tuple(self._steps))

    def groups_to_launch(self) -> list[int]:
        """Groups with no step in flight, in launch order (starting after the group launched last)."""
        busy = {s.group for s in self._steps}
        order = [(self._next + i) % self.depth for i in range(self.depth)]
        return [g for g in order if g not in busy]

    def push(self, step: Launched) -> None:
        assert len(self._steps) < self.depth and all(s.group != step.group for s in self._steps), step.group
        self._steps.append(step)
        self._next = (step.group + 1) % self.depth
        self.max_depth = max(self.max_depth, len(self._steps))

    def pop_oldest(self) -> Launched:
        return self._steps.popleft()

    def drop_all(self) -> list[Launched]:
        """Forget every step in flight (their caches were lost): returned, never collected."""
        dropped = list(self._steps)
        self._steps.clear()
        return dropped
