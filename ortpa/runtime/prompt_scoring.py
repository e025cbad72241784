"""Prompt log-probabilities (``SamplingParams.prompt_logprobs``) from one step's logits.

A logits row at position ``p`` of a sequence scores its token ``p + 1``. A model that returns a row per packed
token (``--logits all``) gives every position of a chunk; one that returns a row per sequence gives the chunk's
last position only, so the Engine prefills a scored prompt one token per chunk (``Request.max_chunk = 1``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ortpa.runtime.logits_processing import token_logprobs

__all__ = ["score_prompts"]


def score_prompts(chunks: Sequence, logits: np.ndarray, rows: np.ndarray) -> None:
    """Fill ``request.prompt_scores`` of the scored chunks from ``logits`` (as the model returned them) and
    ``rows`` (one per chunk: its last position), batched over every position scored this step."""
    per_token = logits.shape[0] != len(chunks) or all(c.num_tokens == 1 for c in chunks)
    where, targets, tops, slots = [], [], [], []
    offset = 0
    for i, c in enumerate(chunks):
        req, start, n = c.request, c.start, c.num_tokens
        if req.prompt_scores is not None:
            first = start if per_token else start + n - 1  # positions whose logits row this step has
            for pos in range(first, min(start + n, req.prompt_len - 1)):
                where.append(offset + pos - start if per_token else i)
                targets.append(req.tokens[pos + 1])
                tops.append(req.sampler.params.prompt_logprobs)
                slots.append((req, pos + 1))
        offset += n
    if where:
        table = logits if per_token else rows
        for (req, slot), lp in zip(slots, token_logprobs(table[where], targets, tops), strict=True):
            req.prompt_scores[slot] = lp
