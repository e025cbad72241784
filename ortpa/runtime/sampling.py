"""Token sampling for the engine: greedy and seeded temperature / top-k / top-p, after the logits controls.

Each request owns a :class:`Sampler` with its own ``numpy.random.Generator``, so a request's draws depend only
on its own logits and seed, never on which other requests share its steps: a seeded request gives the same
tokens alone, in a crowded batch, or after being preempted and recomputed (generated tokens are kept, not
re-drawn). :func:`sample_rows` picks the tokens of a whole step at once; the controls that precede the choice
(``logit_bias``, penalties, ``min_tokens``, token constraints) and the log-probabilities are in
:mod:`ortpa.runtime.logits_processing`, which states their order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ortpa.errors import InvalidSamplingParams
from ortpa.runtime.constraints import TokenConstraint
from ortpa.runtime.logits_processing import RowContext, TokenLogprobs, process_logits, token_logprobs

__all__ = [
    "MAX_LOGPROBS",
    "InvalidSamplingParams",
    "RowContext",
    "Sampled",
    "Sampler",
    "SamplingParams",
    "TokenConstraint",
    "TokenLogprobs",
    "needs_processing",
    "sample_rows",
    "sample_token",
]

MAX_LOGPROBS = 20  # alternatives per position a request may ask for (vLLM's default max_logprobs)


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` is greedy (argmax, lowest token id on ties) and ignores ``top_k`` / ``top_p`` / ``seed``.
    ``top_k == 0`` and ``top_p == 1.0`` disable those filters. A request stops after ``max_new_tokens`` tokens or
    right after emitting any of ``stop_token_ids`` (the stop token is part of the output); before ``min_tokens``
    tokens, the stop tokens cannot be chosen. ``max_new_tokens=0`` is allowed only with ``prompt_logprobs``
    (scoring a prompt, generating nothing).

    ``logit_bias`` (token id -> bias in [-100, 100]) is added to the logits; ``repetition_penalty`` (> 0, 1 is
    off) divides positive and multiplies negative logits of tokens seen in the prompt or output;
    ``frequency_penalty`` and ``presence_penalty`` (in [-2, 2]) subtract ``f * count + p * (count > 0)`` over the
    output. ``logprobs``: the chosen token's log-probability and that many alternatives (0..``MAX_LOGPROBS``);
    ``prompt_logprobs`` the same for every prompt token after the first. ``constraint``: see
    :class:`~ortpa.runtime.constraints.TokenConstraint`.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: fresh OS entropy per request (not reproducible)
    stop_token_ids: Sequence[int] = field(default=())
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | Sequence[tuple[int, float]] = field(default=())
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    constraint: TokenConstraint | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        # Validation raises, never asserts: asserts vanish under `python -O`.
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidSamplingParams(name, f"None or an int in 0..{MAX_LOGPROBS}", value)
        low = 0 if self.prompt_logprobs is not None else 1
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < low:
            what = "an int >= 0 (0 with prompt_logprobs only)" if low == 0 else "an int >= 1"
            raise InvalidSamplingParams("max_new_tokens", what, self.max_new_tokens)
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSamplingParams("temperature", "a finite float >= 0 (0 is greedy)", self.temperature)
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidSamplingParams("top_k", "an int >= 0 (0 disables it)", self.top_k)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams("top_p", "a float in (0, 1] (1 disables it)", self.top_p)
        stops = tuple(int(t) for t in self.stop_token_ids)
        if any(t < 0 for t in stops):
            raise InvalidSamplingParams("stop_token_ids", "non-negative token ids", self.stop_token_ids)
        object.__setattr__(self, "stop_token_ids", stops)  # a hashable, immutable copy
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens:
            raise InvalidSamplingParams("min_tokens", "an int >= 0", self.min_tokens)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (np.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidSamplingParams(name, "a float in [-2, 2] (0 disables it)", value)
        if not (np.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise InvalidSamplingParams("repetition_penalty", "a float > 0 (1 disables it)", self.repetition_penalty)
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        bias = tuple(sorted((int(t), float(v)) for t, v in pairs))
        if any(t < 0 or not (np.isfinite(v) and -100.0 <= v <= 100.0) for t, v in bias):
            raise InvalidSamplingParams("logit_bias", "token ids >= 0 with biases in [-100, 100]", self.logit_bias)
        if len({t for t, _ in bias}) != len(bias):
            raise InvalidSamplingParams("logit_bias", "each token id once", self.logit_bias)
        object.__setattr__(self, "logit_bias", bias)
        # the same pairs as arrays, made once: the sampler scatters them every step
        object.__setattr__(self, "_bias_ids", np.array([t for t, _ in bias], np.int64))
        object.__setattr__(self, "_bias_values", np.array([v for _, v in bias], np.float32))
        if self.constraint is not None and not isinstance(self.constraint, TokenConstraint):
            raise InvalidSamplingParams("constraint", "a TokenConstraint or None", type(self.constraint).__name__)
        # read by sample_rows on every step: computed once
        object.__setattr__(self, "_needs_processing", _needs_processing(self))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def needs_processing(params: SamplingParams) -> bool:
    """Whether a row of this request needs more than the argmax of the model's raw logits: a draw
    (temperature > 0), log-probabilities, or a control of :mod:`ortpa.runtime.logits_processing`."""
    return params._needs_processing  # type: ignore[attr-defined]


def _needs_processing(params: SamplingParams) -> bool:
    return (
        not params.greedy
        or params.logprobs is not None
        or bool(params.logit_bias)
        or params.repetition_penalty != 1.0
        or params.frequency_penalty != 0.0
        or params.presence_penalty != 0.0
        or (bool(params.stop_token_ids) and params.min_tokens > 0)
        or params.constraint is not None
    )


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def sample_token(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator | None) -> int:
    """One token id from a ``[vocab]`` row of logits (temperature / top-k / top-p only; see :func:`sample_rows`)."""
    if params.greedy:  # argmax in the logits' own dtype: no float64 copy of the row
        return int(np.argmax(np.asarray(logits).reshape(-1)))
    if rng is None:
        raise InvalidSamplingParams("seed", "a random generator for temperature > 0", None)
    row = np.asarray(logits).reshape(1, -1)
    return int(_draw(row, [params], [rng])[0])


def _draw(rows: np.ndarray, params: Sequence[SamplingParams], rngs: Sequence[np.random.Generator]) -> np.ndarray:
    """One token per row with temperature > 0, batched: temperature, then top-k, then top-p over what top-k kept.

    Candidates are sorted by descending logit with a stable sort, so ties keep the lowest id first and
    ``top_k=1`` equals greedy. The draw is one uniform per row from the request's own generator (inverse CDF),
    so the stream of draws is fixed by the seed alone.
    """
    x = np.asarray(rows, dtype=np.float64)
    n, vocab = x.shape
    order = np.argsort(-x, axis=1, kind="stable")
    ranked = np.take_along_axis(x, order, axis=1)
    temperature = np.array([p.temperature for p in params])[:, None]
    top_k = np.array([p.top_k or vocab for p in params])[:, None]
    scaled = ranked / temperature
    scaled[np.arange(vocab)[None, :] >= top_k] = -np.inf
    probs = np.exp(scaled - scaled[:, :1])  # column 0 holds each row's maximum: no overflow
    probs /= probs.sum(axis=1, keepdims=True)
    top_p = np.array([p.top_p for p in params])[:, None]
    # smallest prefix whose mass reaches top_p; always keeps the most likely token
    keep = np.minimum((np.cumsum(probs, axis=1) < top_p).sum(axis=1, keepdims=True) + 1, top_k)
    probs[np.arange(vocab)[None, :] >= keep] = 0.0
    cdf = np.cumsum(probs, axis=1)
    u = np.array([rng.random() for rng in rngs])[:, None] * cdf[:, -1:]
    idx = np.minimum((cdf <= u).sum(axis=1), keep[:, 0] - 1)
    return order[np.arange(n), idx]


@dataclass(frozen=True)
class Sampled:
    """What :func:`sample_rows` chose for one row: a token (None: the row's constraint allowed nothing)."""

    token_id: int | None
    logprobs: TokenLogprobs | None  # when the request asked for them


def sample_rows(logits: np.ndarray, samplers: Sequence[Sampler], rows: Sequence[RowContext]) -> list[Sampled]:
    """One token for each row of ``logits`` (``[n, vocab]``, one row per request), batched over the rows.

    Log-probabilities are read from the raw rows (:mod:`ortpa.runtime.logits_processing`), then bias, penalties
    and masks apply, then greedy rows take the argmax and the others draw (:func:`_draw`). Each row depends on
    its own request alone.
    """
    x = np.asarray(logits)
    if x.ndim != 2 or x.shape[0] != len(samplers):
        raise ValueError(f"sample_rows: expected logits [{len(samplers)}, vocab], found shape {x.shape}")
    if not any(needs_processing(s.params) for s in samplers):
        # greedy rows with no controls (the common case): the argmax of the raw rows, lowest id on ties, as below.
        # Each row's chosen logit read back one by one: a fancy index costs ~60 us more per step, the logits being
        # fresh from ONNX Runtime's threads (docs/native.md, "The driver loop")
        tokens = np.argmax(x, axis=1).tolist()
        logit = x.item
        return [Sampled(None if logit(i, t) == -np.inf else t, None) for i, t in enumerate(tokens)]
    processed = process_logits(x, rows)
    tokens = np.argmax(processed, axis=1)
    # a row that allows nothing (every logit -inf): no token, the engine ends the request
    empty = processed.max(axis=1) == -np.inf
    hot = [i for i, s in enumerate(samplers) if not s.params.greedy and not empty[i]]
    if hot:
        tokens[hot] = _draw(processed[hot], [samplers[i].params for i in hot], [samplers[i].rng for i in hot])
    want = [i for i, s in enumerate(samplers) if s.params.logprobs is not None and not empty[i]]
    lps: dict[int, TokenLogprobs] = {}
    if want:
        found = token_logprobs(x[want], tokens[want], [samplers[i].params.logprobs for i in want])
        lps = dict(zip(want, found, strict=True))
    return [Sampled(None if empty[i] else int(tokens[i]), lps.get(i)) for i in range(len(samplers))]


class Sampler:
    """A request's sampling state: its parameters and its own random generator."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = None if params.greedy else np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        return sample_token(logits, self.params, self.rng)
