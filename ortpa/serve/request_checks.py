"""The checks every generating route makes before it admits anything: the model, unsupported fields, ``n``,
``stream_options``; the prompt field's items; ``max_tokens`` against the context."""

from __future__ import annotations

from typing import Any

from ortpa.serve.model import ServingModel
from ortpa.serve.protocol import ApiError

__all__ = ["check_common", "max_tokens_for", "prompt_items"]


def check_common(body: Any, served: ServingModel, max_n: int) -> None:
    if body.model != served.name:
        raise ApiError(
            404,
            f"the model {body.model!r} does not exist: this server serves {served.name!r}",
            param="model",
            code="model_not_found",
        )
    bad = body.unsupported()
    if bad:
        raise ApiError(400, f"'{bad[0]}' is not supported by this server (leave it unset)", param=bad[0])
    if not 1 <= body.n <= max_n:
        raise ApiError(400, f"'n': expected 1 to {max_n} choices (--max-n), found {body.n}", param="n")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "'stream_options' is only allowed with 'stream': true", param="stream_options")


def prompt_items(prompt: Any) -> list[str | list[int]]:
    """The prompt field as a list of prompts, each a string or token ids (a string, strings, token ids, or lists
    of token ids)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "'prompt': expected a string or token ids, found an empty list", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def max_tokens_for(
    requested: int | None, prompts: list[list[int]], served: ServingModel, chat: bool, echo: bool = False
) -> int:
    longest = max(len(p) for p in prompts)
    limit = served.max_model_len
    if requested is None:  # OpenAI's defaults: 16 for completions; chat: the rest of the context
        requested = 16 if not chat else (limit - longest if limit is not None else 256)
        requested = max(requested, 1)
    elif requested < (0 if echo else 1):  # echo with max_tokens 0 scores the prompt alone
        expected = "an integer >= 0 (with 'echo': true)" if echo else "an integer >= 1 (0 only with 'echo': true)"
        raise ApiError(400, f"'max_tokens': expected {expected}, found {requested}", param="max_tokens")
    if limit is not None and longest + requested > limit:
        raise ApiError(
            400,
            f"this model's maximum context length is {limit} tokens, but {longest + requested} were requested "
            f"({longest} in the prompt, {requested} in the completion): shorten the prompt or lower max_tokens",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested
