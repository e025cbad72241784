"""How an OpenAI body becomes the engine's :class:`~ortpa.runtime.sampling.SamplingParams`, each field checked
with a 400 that names it, says what was expected and what was found."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ortpa.errors import InvalidSamplingParams
from ortpa.runtime.sampling import MAX_LOGPROBS, SamplingParams
from ortpa.serve.protocol import ApiError

__all__ = ["logprobs_asked", "sampling_params"]

# SamplingParams' names -> the body's, where they differ
_BODY_NAME = {"max_new_tokens": "max_tokens", "prompt_logprobs": "logprobs"}


def logprobs_asked(body: Any) -> int | None:
    """Alternatives per position the body asks for (0: the chosen token only), or None: no log-probabilities."""
    if isinstance(body.logprobs, bool) or body.logprobs is None:  # chat: logprobs true + top_logprobs
        if body.logprobs:
            return body.top_logprobs or 0
        if getattr(body, "top_logprobs", None) is not None:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return None
    return body.logprobs


def sampling_params(body: Any, max_tokens: int, choice: int, eos: Sequence[int], vocab: int) -> SamplingParams:
    """The engine's parameters for choice ``choice`` of ``body`` (seeds differ per choice so n > 1 differ)."""
    temperature = 1.0 if body.temperature is None else body.temperature
    if body.seed is not None and body.seed < 0:
        raise ApiError(400, f"'seed': expected an integer >= 0, found {body.seed}", param="seed")
    seed = None if body.seed is None else body.seed + choice
    top = logprobs_asked(body)
    name = "top_logprobs" if isinstance(body.logprobs, bool) else "logprobs"
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise ApiError(400, f"'{name}': expected 0 to {MAX_LOGPROBS}, found {top}", param=name)
    echo = getattr(body, "echo", False)
    if max_tokens == 0 and not echo:
        raise ApiError(400, "'max_tokens': expected an integer >= 1 (0 only with 'echo': true)", param="max_tokens")
    if body.min_tokens > max_tokens:
        found = body.min_tokens
        raise ApiError(
            400, f"'min_tokens': expected at most max_tokens ({max_tokens}), found {found}", param="min_tokens"
        )
    stops = list(body.stop_token_ids or [])
    outside = [t for t in stops if not 0 <= t < vocab]
    if outside:
        raise ApiError(
            400,
            f"'stop_token_ids': expected token ids in [0, {vocab}), found {outside[:5]}",
            param="stop_token_ids",
        )
    try:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=temperature,
            top_k=0 if body.top_k == -1 else body.top_k,
            top_p=body.top_p,
            seed=seed,
            # ignore_eos (vLLM's): EOS does not end the choice; stop_token_ids still do
            stop_token_ids=tuple(dict.fromkeys([*(() if getattr(body, "ignore_eos", False) else eos), *stops])),
            min_tokens=body.min_tokens,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=_logit_bias(body.logit_bias, vocab),
            logprobs=top,
            # echo scores the prompt it returns (its log-probabilities when asked; max_tokens 0 needs the path)
            prompt_logprobs=(top if top is not None else 0) if echo and (top is not None or max_tokens == 0) else None,
        )
    except InvalidSamplingParams as exc:
        param = name if exc.name in ("logprobs", "prompt_logprobs") else _BODY_NAME.get(exc.name, exc.name)
        raise ApiError(400, f"'{param}': expected {exc.expected}, found {exc.found!r}", param=param) from None


def _logit_bias(given: dict[str, float] | None, vocab: int) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, bias in (given or {}).items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab or str(token) != key.strip():
            raise ApiError(
                400, f"'logit_bias': expected token ids in [0, {vocab}) as keys, found {key!r}", param="logit_bias"
            )
        if not -100.0 <= bias <= 100.0:
            raise ApiError(
                400, f"'logit_bias': expected biases in [-100, 100], found {bias} for token {token}", param="logit_bias"
            )
        out[token] = bias
    return out
