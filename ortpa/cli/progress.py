"""Progress of long conversions on the command line: a tqdm bar on a terminal, plain lines otherwise.

The converter reports through one callable (``progress(message)``) plus two optional methods that the
conversion looks for: ``layers(total)`` once the input is loaded, ``bytes(done, total)`` while the weights are
written. :class:`ConvertProgress` has all three; ``--quiet`` passes no progress at all.

On a terminal, tqdm draws one line in place: layers while the rewriter works, then bytes (rate, ETA) while the
weights are written, the current stage before the bar. Elsewhere (CI logs, pipes) each stage is one plain line
and the weights' progress one line per 10 %.
"""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

__all__ = ["ConvertProgress"]


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

    # -- what the converter calls ---------------------------------------------------------------------
    def __call__(self, message: str) -> None:
        self.stage = message
        new_layer = message.startswith(("absorbing layer", "rewriting layer"))
        if new_layer:
            self.layer += 1
        if not self.tty:
            print(f"  {message}", file=self.stream, flush=True)
        else:
            bar = self._bar or self._open("stage", None, "")
            if new_layer and self._bar_kind == "layers":
                bar.update(1)
            bar.set_description_str(message, refresh=True)
        if message == "done":
            self.close()

    def layers(self, total: int) -> None:
        self.total_layers = total
        if self.tty:
            self._open("layers", total, " layer", initial=min(self.layer, total))

    def bytes(self, done: int, total: int) -> None:
        self.done_bytes, self.total_bytes = done, total
        if self.tty:
            bar = self._bar if self._bar_kind == "bytes" else self._open("bytes", total, "B", scale=True)
            bar.update(done - bar.n)
            return
        tenth = 10 * done // max(total, 1)
        if tenth != self._last_tenth:
            self._last_tenth = tenth
            print(f"  written {done / 1e9:.2f}/{total / 1e9:.2f} GB ({10 * tenth}%)", file=self.stream, flush=True)

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
