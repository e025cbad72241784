"""ONNX Runtime 1.32's device-side sanitization of PagedAttention's index inputs (reference §3.4(a)).

Malformed values are not rejected: a block-table entry outside ``[-1, num_blocks)`` becomes the unmapped
sentinel -1; ``cumulative_sequence_length`` is clamped into ``[0, token_count]`` with fixed ends and made
non-decreasing (tokens are re-attributed, not dropped); a ``past_seqlens`` entry that is negative or leaves no
room for the sequence's tokens marks the sequence invalid (no cache writes, zero output).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["SanitizedLengths", "sanitize_block_table", "sanitize_lengths"]

_INT32_MAX = np.iinfo(np.int32).max


@dataclass(frozen=True)
class SanitizedLengths:
    """Per-sequence lengths after sanitization; all arrays are int64.

    ``cu_q``: ``[batch + 1]`` token offsets; ``past``: ``[batch]`` (0 where invalid); ``valid``: ``[batch]`` 0/1;
    ``kvlen``: ``[batch]`` live KV length ``min(past + q_len, capacity)`` (0 where invalid);
    ``cu_kv``: ``[batch + 1]`` cumulative ``kvlen``, saturating at INT32_MAX.
    """

    cu_q: np.ndarray
    past: np.ndarray
    valid: np.ndarray
    kvlen: np.ndarray
    cu_kv: np.ndarray

    @property
    def q_len(self) -> np.ndarray:
        return np.diff(self.cu_q)


def sanitize_block_table(block_table: np.ndarray, num_blocks: int) -> np.ndarray:
    """Entries outside ``[-1, num_blocks)`` become -1 (unmapped); returns a new int64 array."""
    bt = np.asarray(block_table).astype(np.int64)
    return np.where((bt >= -1) & (bt < num_blocks), bt, -1)


def sanitize_lengths(
    cumulative_sequence_length: np.ndarray,
    past_seqlens: np.ndarray,
    max_blocks_per_seq: int,
    block_size: int,
    token_count: int,
) -> SanitizedLengths:
    cu = np.asarray(cumulative_sequence_length).astype(np.int64).reshape(-1)
    past = np.asarray(past_seqlens).astype(np.int64).reshape(-1)
    batch = cu.shape[0] - 1
    if batch < 1 or past.shape[0] != batch:
        raise ValueError(
            f"sanitize_lengths: expected cumulative_sequence_length of shape (batch + 1) with batch >= 1 and "
            f"past_seqlens of shape (batch), found {cu.shape} and {past.shape}"
        )
    c = np.clip(cu, 0, token_count)
    c[0], c[batch] = 0, token_count
    c = np.maximum.accumulate(c)
    q_len = np.diff(c)
    cap = max_blocks_per_seq * block_size
    max_past = np.maximum(cap - q_len, 0)
    ok = (past >= 0) & (past <= max_past)
    past_s = np.where(ok, past, 0)
    kvlen = np.where(ok, np.minimum(past_s + q_len, cap), 0)
    cu_kv = np.minimum(np.concatenate([[0], np.cumsum(kvlen)]), _INT32_MAX)
    return SanitizedLengths(cu_q=c, past=past_s, valid=ok.astype(np.int64), kvlen=kvlen, cu_kv=cu_kv)
