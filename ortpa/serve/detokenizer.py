"""Incremental detokenization with stop strings: the text a stream sends, chunk by chunk.

:class:`TextStream` turns a request's tokens into text deltas such that

* a multi-byte character split over tokens (byte-level BPE) is never sent in halves: a decode that ends in
  U+FFFD (an incomplete UTF-8 sequence) is held back until the next token completes it;
* the spaces a tokenizer's decoder puts between tokens are kept: each delta is the difference between the
  decode of a short window ending at the new tokens and the decode of that window without them (vLLM's and
  TGI's scheme), so ``"hello"`` then ``"world"`` give ``"hello"`` and ``" world"``;
* a stop string is never split across chunks: text that could be the start of a stop string is held back
  until it is known not to be one; the stop string itself and what follows it are never sent;
* the concatenated deltas equal the text a non-streamed request returns (both come from this class), which is
  ``tokenizer.decode(tokens)`` when no stop string matched.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["TextStream"]

_INCOMPLETE = "\ufffd"


class TextStream:
    """One choice's text. ``push`` tokens as they come, send what it returns; ``finish`` flushes the rest.

    ``skip_ids`` (EOS ids) are not decoded: ``ortpa generate`` drops them from its text the same way.
    ``stopped`` turns true once a stop string matched; later tokens are ignored; a stop string completed
    within the first ``min_tokens`` tokens is text like any other. ``context``: tokens that come
    before (the end of an echoed prompt), decoded only as the first window, so that the first delta carries the
    space a tokenizer puts after them; without it the text is decoded on its own.
    """

    def __init__(
        self,
        tokenizer: Any,
        stop: Sequence[str] = (),
        skip_ids: Iterable[int] = (),
        context: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> None:
        self._tok = tokenizer
        self._stop = [s for s in stop if s]
        self._min_tokens = min_tokens  # stop strings end nothing before this many tokens (vLLM's min_tokens)
        self._count = 0
        self._skip = frozenset(skip_ids)
        self._ids: list[int] = [t for t in context if t not in self._skip]
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # tokens whose text is already in self._text (the context's is not)
        self._text = ""  # decoded text so far (before stop-string truncation)
        self._sent = 0  # characters of self._text already returned
        self.stopped = False
        self.stop_reason: str | None = None  # the stop string that matched

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self._text[: self._sent]

    def push(self, token_ids: Iterable[int]) -> str:
        if self.stopped:
            return ""
        token_ids = list(token_ids)
        self._count += len(token_ids)
        self._ids.extend(t for t in token_ids if t not in self._skip)
        window = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        if len(full) > len(window) and not full.endswith(_INCOMPLETE):
            self._text += full[len(window) :]
            self._prefix, self._read = self._read, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest: held-back text, incomplete characters included (as U+FFFD, like a full decode)."""
        if not self.stopped and self._read < len(self._ids):
            window = self._tok.decode(self._ids[self._prefix : self._read])
            full = self._tok.decode(self._ids[self._prefix :])
            self._text += full[len(window) :]
            self._read = len(self._ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if not self.stopped and self._stop and self._count >= self._min_tokens:
            # a stop string can start in held-back text: search from the earliest unsent char it could span
            start = max(0, self._sent - max(len(s) for s in self._stop) + 1)
            hits = [(i, s) for s in self._stop if (i := self._text.find(s, start)) >= 0]
            if hits:
                at, which = min(hits)
                self._text = self._text[:at]
                self.stopped, self.stop_reason = True, which
        end = len(self._text)
        if not self.stopped and not final:
            end -= self._held_back()
        delta = self._text[self._sent : max(end, self._sent)]
        self._sent += len(delta)
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._text)), best, -1):
                if self._text.endswith(s[:k]):
                    best = k
                    break
        return best
