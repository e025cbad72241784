"""The most bytes of prompt text one token can cover, read from the tokenizer's own description (its JSON).

With such a bound B, a prompt of N bytes has at least ceil(N / B) tokens, so a prompt that cannot fit the context
is refused before it is tokenized. The bound holds only when every byte of the text ends in some token of bounded
length; a tokenizer that can drop text (whitespace split off and discarded, characters outside the vocabulary
without an unknown token) or fold any length of it into one token (WordLevel's and WordPiece's unknown token,
fused unknown characters, added tokens that swallow the whitespace around them) has none, and
:func:`token_bound` says why. Byte-level BPE with all 256 bytes in its vocabulary (GPT-2, Llama 3, Qwen) and
SentencePiece BPE with byte fallback (Llama 2, Mistral, Gemma) have one.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["TokenBound", "min_tokens", "token_bound"]

_UTF8_MAX = 4  # bytes of one character
# A Unicode normal form or lowercasing never deletes a character but can shrink one: U+1D400 (4 bytes) is "A"
# under NFKC, U+212A KELVIN SIGN (3 bytes) is "K" under NFC and "k" lowercased, three Hangul jamo (9 bytes) compose
# into one syllable (3 bytes): at most 4 input bytes per normalized byte.
_SHRINKING = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_GROWING = {"Prepend", "ByteLevel"}  # every input byte stays, possibly as more bytes
_KEEPING_PRE = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "FixedLength"}
_DROPPING_PRE = {"Whitespace", "WhitespaceSplit", "BertPreTokenizer", "CharDelimiterSplit"}


@dataclass(frozen=True)
class TokenBound:
    """``max_bytes_per_token``: the most UTF-8 bytes of text one token covers; None, with ``why``, when no bound
    holds for this tokenizer."""

    max_bytes_per_token: int | None
    why: str = ""


def min_tokens(n_bytes: int, bound: TokenBound) -> int:
    """The fewest tokens a text of ``n_bytes`` bytes can become (0 when the tokenizer has no bound)."""
    if bound.max_bytes_per_token is None:
        return 0
    return -(-n_bytes // bound.max_bytes_per_token)


def token_bound(tokenizer: Any) -> TokenBound:
    """The bound of a ``tokenizers.Tokenizer`` (read from ``tokenizer.to_str()``)."""
    spec = json.loads(tokenizer.to_str())
    factor, why = _normalizer_factor(spec.get("normalizer"))
    if factor is None:
        return TokenBound(None, why)
    why = _pre_tokenizer_drops(spec.get("pre_tokenizer"))
    if why:
        return TokenBound(None, why)
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return TokenBound(None, f"the added token {added.get('content')!r} swallows the whitespace beside it")
    longest, why = _model_longest(spec["model"], _byte_level(spec))
    if longest is None:
        return TokenBound(None, why)
    added = [len(str(t.get("content", "")).encode()) for t in spec.get("added_tokens") or []]
    return TokenBound(math.ceil(max([longest, *added]) * factor))


def _normalizer_factor(node: dict | None) -> tuple[float | None, str]:
    """How many input bytes one normalized byte can stand for (None: unbounded, with why)."""
    if node is None:
        return 1.0, ""
    kind = node.get("type")
    if kind == "Sequence":
        total = 1.0
        for child in node.get("normalizers") or []:
            factor, why = _normalizer_factor(child)
            if factor is None:
                return None, why
            total *= factor
        return total, ""
    if kind in _GROWING:
        return 1.0, ""
    if kind in _SHRINKING:
        return float(_UTF8_MAX), ""
    if kind == "Replace":
        pattern, content = node.get("pattern") or {}, node.get("content") or ""
        if "String" in pattern and content:
            return max(1.0, len(pattern["String"].encode()) / len(content.encode())), ""
        return None, "its Replace normalizer can delete text (a regex pattern, or an empty replacement)"
    return None, f"its {kind} normalizer can delete text"


def _pre_tokenizer_drops(node: dict | None) -> str:
    """Why the pre-tokenizer can discard text ("" when it keeps every byte)."""
    if node is None:
        return ""
    kind = node.get("type")
    if kind == "Sequence":
        return next((w for c in node.get("pretokenizers") or [] if (w := _pre_tokenizer_drops(c))), "")
    if kind in _KEEPING_PRE or (kind == "Split" and node.get("behavior") != "Removed"):
        return ""
    if kind in _DROPPING_PRE or kind == "Split":
        return f"its {kind} pre-tokenizer discards the text it splits on (whitespace: no token at all)"
    return f"its {kind} pre-tokenizer is not known to keep every byte"


def _byte_level(spec: dict) -> bool:
    def has(node: dict | None, key: str) -> bool:
        if node is None:
            return False
        if node.get("type") == "ByteLevel":
            return True
        return any(has(c, key) for c in node.get(key) or [])

    return has(spec.get("pre_tokenizer"), "pretokenizers") or has(spec.get("normalizer"), "normalizers")


def _model_longest(model: dict, byte_level: bool) -> tuple[int | None, str]:
    """The most (normalized) bytes one token of the model covers, or None and why."""
    kind = model.get("type")
    if kind not in ("BPE", "Unigram"):
        return None, f"its {kind} model turns an unknown word of any length into one token"
    vocab = model.get("vocab") or {}
    pieces = list(vocab) if isinstance(vocab, dict) else [entry[0] for entry in vocab]  # Unigram: [piece, score]
    if byte_level:  # one character of the byte-level alphabet per byte of text
        longest = max((len(p) for p in pieces), default=1)
        singles = {p for p in pieces if len(p) == 1}
        if len(singles) >= 256:
            return longest, ""
    else:
        longest = max((len(p.encode()) for p in pieces), default=1)
    if model.get("byte_fallback"):
        return longest, ""
    if kind == "Unigram":
        return None, "its Unigram model folds runs of unknown characters into one token"
    if model.get("unk_token") is None:
        return None, "its BPE model drops characters outside its vocabulary (no unknown token, no byte fallback)"
    if model.get("fuse_unk"):
        return None, "its BPE model folds runs of unknown characters into one token"
    return max(longest, _UTF8_MAX), ""  # an unknown character alone is one token
