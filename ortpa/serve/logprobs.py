"""Log-probabilities in OpenAI's two shapes: chat's ``{"content": [{token, logprob, bytes, top_logprobs}]}``
and completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``.

Values are the engine's raw log-probabilities (the model's own logits, before ``logit_bias``, penalties and
temperature; :mod:`ortpa.runtime.logits_processing`), float32 values written as JSON numbers. A token's text is
its id decoded alone (special tokens included), as vLLM writes it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from ortpa.runtime.logits_processing import TokenLogprobs

__all__ = ["TokenText", "chat_logprobs", "completion_logprobs"]


class TokenText:
    """Token id -> its text, decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.text = functools.lru_cache(maxsize=65536)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)


def chat_logprobs(entries: Sequence[TokenLogprobs], text: TokenText, top: int) -> dict[str, Any]:
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        s = text.text(token_id)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top[:top]]} for e in entries
        ],
        "refusal": None,
    }


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], text: TokenText, start: int = 0
) -> dict[str, Any]:
    """One entry per token of ``token_ids``; None for a prompt's first token (nothing precedes it to score it).

    ``top_logprobs`` maps each alternative's text to its log-probability and always holds the chosen token
    (vLLM's shape: harnesses compare the chosen token with the best of the map to tell greedy continuations).
    ``text_offset``: where each token's text starts in the choice's text, the first at ``start``.
    """
    tokens, values, tops, offsets = [], [], [], []
    offset = start
    for token_id, e in zip(token_ids, entries, strict=True):
        s = text.text(token_id)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if e is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(e.logprob)
        alts = {text.text(t): lp for t, lp in e.top}
        alts.setdefault(s, e.logprob)
        tops.append(alts)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
