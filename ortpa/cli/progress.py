"""Progress of long conversions on the command line: a tqdm bar on a terminal, plain lines otherwise.

The conversion reports typed events (:mod:`ortpa.progress`): :class:`~ortpa.progress.LayerStarted` while the
rewriter works through the layers, :class:`~ortpa.progress.BytesWritten` while the weights are written, and
:class:`~ortpa.progress.StageStarted` for everything else. :class:`ConvertProgress` draws them; ``--quiet``
passes no progress at all.

On a terminal, tqdm draws one line in place: layers while the rewriter works, then bytes (rate, ETA) while the
weights are written, the current stage before the bar. Elsewhere (CI logs, pipes) each stage is one plain line
and the weights' progress one line per 10 %.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

from ortpa.progress import BytesWritten, LayerStarted, ProgressEvent, Stage, StageStarted

__all__ = ["ConvertProgress"]


_MIN_RATE_SECONDS = 0.05  # below this a rate is one tensor's write time, not a throughput


class ConvertProgress:
    """Progress display for ``ortpa convert``; ``tty=None`` asks the stream."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(self.stream.isatty()) if tty is None else tty
        self.total_layers: int | None = None
        self.layer = 0
        self.done_bytes = 0
        self.total_bytes = 0
        self.stage = ""
        self._bar: tqdm | None = None
        self._bar_kind = ""
        self._last_tenth = -1
        self._bytes_stage: Stage | None = None
        self._bytes_started = time.monotonic()
        self._bytes_first = 0  # the count's first report: what was written before the clock started

    # -- what the conversion calls ------------------------------------------------------------------
    def __call__(self, event: ProgressEvent) -> None:
        if isinstance(event, BytesWritten):
            self._bytes(event.done, event.total, event.stage)
            return
        message = str(event)
        self.stage = message
        if isinstance(event, LayerStarted):
            self.total_layers, self.layer = event.total, event.index + 1
        if not self.tty:
            print(f"  {message}", file=self.stream, flush=True)
        elif isinstance(event, LayerStarted):
            bar = self._bar if self._bar_kind == "layers" else self._open("layers", event.total, " layer")
            bar.update(self.layer - bar.n)
            bar.set_description_str(message, refresh=True)
        else:
            bar = self._bar if self._bar is not None else self._open("stage", None, "")
            bar.set_description_str(message, refresh=True)
        if isinstance(event, StageStarted) and event.stage is Stage.DONE:
            self.close()

    def _bytes(self, done: int, total: int, stage: Stage) -> None:
        if stage is not self._bytes_stage or total != self.total_bytes:  # a new count: the export's, then the write's
            self._bytes_stage, self._bytes_started, self._last_tenth = stage, time.monotonic(), -1
            self._bytes_first = done
            if self._bar_kind == "bytes":
                self.close()
        self.done_bytes, self.total_bytes = done, total
        if self.tty:
            bar = self._bar if self._bar_kind == "bytes" else self._open("bytes", total, "B", scale=True)
            bar.update(done - bar.n)
            return
        tenth = 10 * done // max(total, 1)
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            line = f"  written {done / 1e9:.2f}/{total / 1e9:.2f} GB ({10 * tenth}%)"
            elapsed = time.monotonic() - self._bytes_started
            # the rate of what was written since the count's first report (its first tensor was written before
            # any clock started: counted in, it made the first rate thousands of GB/s)
            if self._bytes_first < done < total and elapsed > _MIN_RATE_SECONDS:
                rate = (done - self._bytes_first) / elapsed
                line += f", {rate / 1e6:.0f} MB/s, ETA {_clock((total - done) / rate)}"
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar, self._bar_kind = None, ""

    # -- rendering ------------------------------------------------------------------------------------
    def _open(self, kind: str, total: int | None, unit: str, initial: int = 0, scale: bool = False) -> tqdm:
        self.close()
        self._bar = tqdm(
            total=total,
            initial=initial,
            unit=unit,
            unit_scale=scale,
            unit_divisor=1000,
            file=self.stream,
            leave=False,
            dynamic_ncols=True,
            # a bare stage line until the converter knows what it counts
            bar_format="{desc}" if total is None else None,
        )
        self._bar_kind = kind
        if self.stage:
            self._bar.set_description_str(self.stage, refresh=True)
        return self._bar


def _clock(seconds: float) -> str:
    """``h:mm:ss`` (or ``m:ss``), as tqdm shows an ETA."""
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"
