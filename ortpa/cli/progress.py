"""Progress of long conversions on the command line: a bar on a terminal, plain lines otherwise.

The converter reports through one callable (``progress(message)``) plus two optional methods that
:mod:`ortpa.rewriter.model_store` looks for: ``layers(total)`` once the input is loaded, ``bytes(done, total)``
while the weights are written. :class:`ConvertProgress` has all three; ``--quiet`` passes no progress at all.

On a TTY one line is redrawn in place::

    [##########----------]  layer 9/16  2.1/5.7 GB  212 MB/s  ETA 0:17  absorbing layer 8

Elsewhere (CI logs, pipes) each stage is one plain line and the weights' progress one line per 10 %.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

__all__ = ["ConvertProgress"]

_WIDTH = 20


def _eta(seconds: float) -> str:
    seconds = max(0, int(seconds))
    if seconds >= 3600:
        return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
    return f"{seconds // 60}:{seconds % 60:02d}"


class ConvertProgress:
    """Progress display for ``ortpa convert``; ``tty=None`` asks the stream."""

    def __init__(self, stream: TextIO | None = None, tty: bool | None = None, clock=time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.tty = bool(self.stream.isatty()) if tty is None else tty
        self.clock = clock
        self.total_layers: int | None = None
        self.layer = 0
        self.done_bytes = 0
        self.total_bytes = 0
        self.stage = ""
        self._layer_start: float | None = None
        self._bytes_start: float | None = None
        self._last_tenth = -1
        self._drawn = False

    # -- what the converter calls ---------------------------------------------------------------------
    def __call__(self, message: str) -> None:
        if message.startswith(("absorbing layer", "rewriting layer")):
            if self._layer_start is None:
                self._layer_start = self.clock()
            self.layer += 1
        self.stage = message
        if self.tty:
            self._draw()
        else:
            print(f"  {message}", file=self.stream, flush=True)
        if message == "done":
            self.close()

    def layers(self, total: int) -> None:
        self.total_layers = total

    def bytes(self, done: int, total: int) -> None:
        if self._bytes_start is None:
            self._bytes_start = self.clock()
        self.done_bytes, self.total_bytes = done, total
        if self.tty:
            self._draw()
            return
        tenth = 10 * done // max(total, 1)
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            print(f"  written {done / 1e9:.2f}/{total / 1e9:.2f} GB ({10 * tenth}%)", file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and self._drawn:
            print(file=self.stream, flush=True)
            self._drawn = False

    # -- rendering ------------------------------------------------------------------------------------
    def line(self) -> str:
        """The bar line for the current state (what a terminal shows)."""
        now = self.clock()
        parts = []
        if self.total_bytes and self._bytes_start is not None:
            frac = min(1.0, self.done_bytes / self.total_bytes)
            elapsed = now - self._bytes_start
            rate = self.done_bytes / elapsed if elapsed > 0 else 0.0
            eta = (self.total_bytes - self.done_bytes) / rate if rate > 0 else None
            parts.append(f"{self.done_bytes / 1e9:.1f}/{self.total_bytes / 1e9:.1f} GB")
            parts.append(f"{rate / 1e6:.0f} MB/s")
        elif self.total_layers:
            frac = min(self.layer, self.total_layers) / self.total_layers
            elapsed = now - self._layer_start if self._layer_start is not None else 0.0
            per_layer = elapsed / max(self.layer - 1, 1) if self.layer > 1 else None
            eta = per_layer * (self.total_layers - self.layer + 1) if per_layer is not None else None
        else:
            frac, eta = 0.0, None
        filled = round(frac * _WIDTH)
        head = f"[{'#' * filled}{'-' * (_WIDTH - filled)}]"
        if self.total_layers:
            parts.insert(0, f"layer {min(self.layer, self.total_layers)}/{self.total_layers}")
        parts.append(f"ETA {_eta(eta)}" if eta is not None else "ETA --")
        return "  ".join([head, *parts, self.stage])

    def _draw(self) -> None:
        self.stream.write("\r\x1b[2K" + self.line())
        self.stream.flush()
        self._drawn = True
