"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``) from one step's logits, and which rows a step asks for.

A logits row at position ``p`` of a sequence scores its token ``p + 1``. Which rows a step returns depends on the
model (:func:`step_rows`): one per packed token (``--logits all``) gives every position of a chunk; a model with
the ``logits_indices`` input (the default conversion) computes the rows the step names, every position of a chunk
whose prompt is scored and the last of the others, so a scored prompt is prefilled in chunks as any other; a
model with neither gives each chunk's last position only, so the Engine prefills a scored prompt one token per
chunk (``Request.max_chunk = 1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from ortpa.errors import InvalidModel
from ortpa.runtime.logits_processing import token_logprobs

__all__ = ["RowsMode", "StepRows", "score_prompts", "step_rows"]

RowsMode = Literal["last", "all", "indices"]  # what the model returns: see the module docstring


@dataclass(frozen=True)
class StepRows:
    """The logits rows of one step: chunk ``i`` has rows ``first[i] .. first[i] + count[i] - 1``, for its last
    ``count[i]`` positions; ``indices`` is the ``logits_indices`` feed (None: the model's default rows)."""

    first: np.ndarray
    count: np.ndarray
    indices: np.ndarray | None

    @property
    def last(self) -> np.ndarray:
        """Each chunk's row for its last position (the one a sampled token is drawn from)."""
        return self.first + self.count - 1

    @property
    def total(self) -> int:
        return int(self.count.sum())

    def check(self, logits: np.ndarray) -> None:
        if logits.ndim != 2 or logits.shape[0] != self.total:
            raise InvalidModel(
                "logits", f"expected a 2-D output with {self.total} rows for this step, found shape {logits.shape}"
            )


def step_rows(chunks: Sequence, mode: RowsMode) -> StepRows:
    """The rows a step of ``chunks`` gets from a model of ``mode``: every position of a scored chunk where the
    model can give them, else each chunk's last."""
    sizes = np.array([c.num_tokens for c in chunks], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    if mode == "all":
        return StepRows(offsets, sizes, None)
    scored = np.array([c.request.prompt_scores is not None for c in chunks], bool)
    if mode == "last" or not scored.any():  # the model's default: one row per sequence, nothing to feed
        return StepRows(np.arange(len(chunks), dtype=np.int64), np.ones(len(chunks), np.int64), None)
    count = np.where(scored, sizes, 1)
    first = np.concatenate([[0], np.cumsum(count)[:-1]]).astype(np.int64)
    indices = np.concatenate(
        [np.arange(o + s - k, o + s, dtype=np.int64) for o, s, k in zip(offsets, sizes, count, strict=True)]
    )
    return StepRows(first, count, indices)


def score_prompts(chunks: Sequence, logits: np.ndarray, rows: StepRows) -> None:
    """Fill ``request.prompt_scores`` of the scored chunks from ``logits`` (the step's rows, as ``rows`` says),
    batched over every position scored this step."""
    where, targets, tops, slots = [], [], [], []
    for i, c in enumerate(chunks):
        req, start, n = c.request, c.start, c.num_tokens
        if req.prompt_scores is None:
            continue
        k = int(rows.count[i])
        first_pos = start + n - k  # the first position whose logits row this step has
        for pos in range(first_pos, min(start + n, req.prompt_len - 1)):
            where.append(int(rows.first[i]) + pos - first_pos)
            targets.append(req.tokens[pos + 1])
            tops.append(req.sampler.params.prompt_logprobs)
            slots.append((req, pos + 1))
    if where:
        for (req, slot), lp in zip(slots, token_logprobs(logits[where], targets, tops), strict=True):
            req.prompt_scores[slot] = lp
