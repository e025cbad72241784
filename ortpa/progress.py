"""What a conversion reports while it runs: typed events, one stage enum, one callable protocol.

Every step of a conversion (the export of a checkpoint, the rewrite, writing, the checks, verification, the
portable lowering, the deployment files) reports through one :class:`Progress` callable. Displays decide from the
event's type and fields, never from its text: :class:`LayerStarted` advances a layer count, :class:`BytesWritten`
a byte count, :class:`StageStarted` names the stage. ``str(event)`` is the line a person reads, so a plain
``print`` is a valid progress callable.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "BytesWritten",
    "LayerStarted",
    "Progress",
    "ProgressEvent",
    "Stage",
    "StageStarted",
    "report",
    "reporter",
]


class Stage(enum.Enum):
    """The stages of a conversion, in the order they run (some are skipped by options)."""

    EXPORT = "export"  # a Hugging Face checkpoint -> dense ONNX (convert HF_DIR)
    LOAD = "load"
    OPTIMISE = "optimise"  # onnxscript's optimizer, folding, shape recovery
    MATCH = "match"  # recognising every attention layer
    REWRITE = "rewrite"  # one PagedAttention node per layer (LayerStarted events)
    FINISH = "finish"  # paged interface, per-sequence values, dtype, int8 scales
    WRITE = "write"  # weights streamed to the staging folder (BytesWritten events)
    CHECK = "check"  # onnx.checker, ortpa's node validation, ONNX Runtime opening the graph
    VERIFY = "verify"  # the converted model against its original
    LOWER = "lower"  # --portable: PagedAttention -> standard ONNX ops
    DEPLOY = "deploy"  # genai_config.json and the companion files
    DONE = "done"  # moved into place


@dataclass(frozen=True)
class StageStarted:
    stage: Stage
    message: str

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class LayerStarted:
    """The rewrite of one attention layer begins: ``index`` of ``total`` (0-based), the model's ``layer`` number."""

    index: int
    total: int
    layer: int
    message: str
    stage: Stage = Stage.REWRITE

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class BytesWritten:
    """``done`` of ``total`` bytes of weights written."""

    done: int
    total: int
    stage: Stage = Stage.WRITE

    def __str__(self) -> str:
        return f"written {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB"


ProgressEvent = StageStarted | LayerStarted | BytesWritten


class Progress(Protocol):
    def __call__(self, event: ProgressEvent, /) -> None: ...


def report(progress: Progress | None, stage: Stage, message: str) -> None:
    """Send a :class:`StageStarted` when there is someone to tell."""
    if progress is not None:
        progress(StageStarted(stage, message))


def reporter(progress: Progress | None, stage: Stage) -> Callable[[str], None] | None:
    """A ``str`` callback for code that reports in lines (an export, verification): each line one event of
    ``stage``; None when ``progress`` is."""
    if progress is None:
        return None
    return lambda message: progress(StageStarted(stage, message))
