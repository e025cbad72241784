"""Token sampling for the engine: greedy, and seeded temperature / top-k / top-p sampling.

Each request owns a :class:`Sampler` with its own ``numpy.random.Generator``, so a request's draws depend only
on its own logits and seed, never on which other requests share its steps: a seeded request gives the same
tokens alone, in a crowded batch, or after being preempted and recomputed (generated tokens are kept, not
re-drawn).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from ortpa.errors import InvalidSamplingParams
from ortpa.runtime.constraints import TokenConstraint

__all__ = ["InvalidSamplingParams", "Sampler", "SamplingParams", "sample_token"]


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` is greedy (argmax, lowest token id on ties) and ignores ``top_k`` / ``top_p`` / ``seed``.
    ``top_k == 0`` and ``top_p == 1.0`` disable those filters. A request stops after ``max_new_tokens`` tokens or
    right after emitting any of ``stop_token_ids`` (the stop token is part of the output). A ``constraint``
    restricts every token to those its grammar allows (applied by the engine to the batch's logits before the
    filters above) and ends the request with "stop" once its grammar is complete.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: fresh OS entropy per request (not reproducible)
    stop_token_ids: Sequence[int] = field(default=())
    # structured output / forced tool calls: masks the logits before sampling, finishes the request when done
    constraint: TokenConstraint | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Validation raises, never asserts: asserts vanish under `python -O`.
        if not isinstance(self.max_new_tokens, (int, np.integer)) or self.max_new_tokens < 1:
            raise InvalidSamplingParams("max_new_tokens", "an int >= 1", self.max_new_tokens)
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSamplingParams("temperature", "a finite float >= 0 (0 is greedy)", self.temperature)
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise InvalidSamplingParams("top_k", "an int >= 0 (0 disables it)", self.top_k)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams("top_p", "a float in (0, 1] (1 disables it)", self.top_p)
        stops = tuple(int(t) for t in self.stop_token_ids)
        if any(t < 0 for t in stops):
            raise InvalidSamplingParams("stop_token_ids", "non-negative token ids", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stops)  # a hashable, immutable copy

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """One token id from a ``[vocab]`` row of logits.

    Filtering order is vLLM's: temperature, then top-k, then top-p over what top-k kept. Candidates are sorted
    by descending logit with a stable sort, so ties keep the lowest id first and ``top_k=1`` equals greedy.
    """
    if params.greedy:  # argmax in the logits' own dtype: no float64 copy of the row
        return int(np.argmax(np.asarray(logits).reshape(-1)))
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    if rng is None:
        raise InvalidSamplingParams("seed", "a random generator for temperature > 0", None)
    order = np.argsort(-row, kind="stable")
    if params.top_k:
        order = order[: params.top_k]
    scaled = row[order] / params.temperature
    probs = np.exp(scaled - scaled[0])  # order[0] holds the maximum: no overflow
    probs /= probs.sum()
    if params.top_p < 1.0:
        # smallest prefix whose mass reaches top_p; always keeps the most likely token
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
    # inverse-CDF draw: one uniform per token, so the stream of draws is fixed by the seed alone
    idx = int(np.searchsorted(np.cumsum(probs), rng.random(), side="right"))
    return int(order[min(idx, len(order) - 1)])


class Sampler:
    """A request's sampling state: its parameters and its own random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = None if params.greedy else np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        return sample_token(logits, self.params, self.rng)
