"""Per-request token constraints the batched sampler applies (structured output, forced tool calls)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["TokenConstraint"]


@runtime_checkable
class TokenConstraint(Protocol):
    """A request's grammar state: which tokens may come next, advanced by each chosen token."""

    def allowed_mask(self, vocab_size: int) -> np.ndarray:
        """Boolean ``[vocab_size]``: True where the next token is allowed."""
        ...

    def advance(self, token_id: int) -> None:
        """Consume the chosen token."""
        ...

    def is_terminated(self) -> bool:
        """True once the grammar has accepted a complete output (the request then finishes with "stop")."""
        ...
