"""What one request may send, as a deployment sets it (``ortpa serve --max-body-bytes ...``,
``build_app(limits=...)``). Plain data, importable without the ``serve`` extra (the CLI reads its defaults); the
checks that enforce it: :mod:`ortpa.serve.guards` (body, API keys), :mod:`ortpa.serve.prompts` (prompt bytes),
:mod:`ortpa.serve.request_checks` (``n``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServeLimits"]

MIB = 1 << 20


# A whole prompt averages 3 to 5 bytes per token in common tokenizers; 16 leaves room for text that tokenizes
# poorly while bounding the tokenizing a request can ask for by the context it can use.
PROMPT_BYTES_PER_TOKEN = 16
MAX_DEFAULT_PROMPT_BYTES = 1 * MIB
# A body holds the prompt (text, escaped, or token ids of up to 8 bytes each) and the other fields; it is parsed
# on the event loop, 12 to 45 ms per MiB, so the default is no larger than the context needs: twice the prompt's.
BODY_BYTES_PER_TOKEN = 2 * PROMPT_BYTES_PER_TOKEN
MIN_DEFAULT_BODY_BYTES = 256 << 10  # room for schemas, tools and logit_bias beside a small model's prompt
MAX_DEFAULT_BODY_BYTES = 2 * MIB


@dataclass(frozen=True)
class ServeLimits:
    """``max_body_bytes``: a request body's size (413 past it); None: :meth:`body_bytes` derives it from the context.
    ``max_prompt_bytes``: the UTF-8 bytes of a request's prompt text (completions: its prompt strings together; chat
    and ``/tokenize``: the prompt the chat template renders) (400); None: :meth:`prompt_bytes` derives it from the
    context. ``max_n``: choices per request (400). ``max_concurrent_per_key``: requests one API key may have in
    flight when keys are configured (429)."""

    max_body_bytes: int | None = None
    max_prompt_bytes: int | None = None
    max_n: int = 16
    max_concurrent_per_key: int = 32

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_prompt_bytes", "max_n", "max_concurrent_per_key"):
            value = getattr(self, name)
            if name in ("max_body_bytes", "max_prompt_bytes") and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ServeLimits.{name}: expected a positive int, found {value!r}")

    def body_bytes(self, max_model_len: int | None) -> int:
        """``max_body_bytes``, or by default 32 bytes per token of the served context, from 256 KiB to 2 MiB (2 MiB
        when the context is unknown)."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        if max_model_len is None:
            return MAX_DEFAULT_BODY_BYTES
        return min(MAX_DEFAULT_BODY_BYTES, max(MIN_DEFAULT_BODY_BYTES, BODY_BYTES_PER_TOKEN * max_model_len))

    def prompt_bytes(self, max_model_len: int | None) -> int:
        """``max_prompt_bytes``, or by default 16 bytes per token of the served context, at most 1 MiB (1 MiB when
        the context is unknown)."""
        if self.max_prompt_bytes is not None:
            return self.max_prompt_bytes
        if max_model_len is None:
            return MAX_DEFAULT_PROMPT_BYTES
        return min(MAX_DEFAULT_PROMPT_BYTES, PROMPT_BYTES_PER_TOKEN * max_model_len)
