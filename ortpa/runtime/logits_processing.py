"""What happens to a step's logits rows between the model and the token choice, batched over the rows.

Order (vLLM's and OpenAI's): log-probabilities are read first, from the model's own logits (below), then
``logit_bias`` is added, then the penalties (repetition over prompt + output, frequency and presence over the
output), then the masks (stop tokens before ``min_tokens``, a request's :class:`TokenConstraint`), and the
temperature / top-k / top-p of :mod:`ortpa.runtime.sampling` last.

Log-probabilities are vLLM's default ``raw_logprobs``: ``log_softmax`` of the model's logits row, before
``logit_bias``, penalties, masks, temperature and top-k / top-p, computed in float64 and returned as float32
values. A log-probability is therefore a property of the model and the text alone (what an evaluation harness
scores), the same whatever sampling controls a request sets.

Every function takes the rows of one step and works on whole arrays: loops run over the requests that set a
control (to build index arrays), never over the vocabulary. A row's result depends on that row alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["RowContext", "TokenLogprobs", "log_softmax", "process_logits", "token_logprobs"]


@dataclass(frozen=True)
class TokenLogprobs:
    """A token's log-probability and the ``top`` most likely tokens at its position, best first."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token (ties: the lowest id ranks first)
    top: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class RowContext:
    """What the processors read of one row's request: its parameters and its tokens so far."""

    params: object  # ortpa.runtime.sampling.SamplingParams (not imported: that module imports this one)
    tokens: Sequence[int]  # prompt followed by the generated tokens
    prompt_len: int

    @property
    def output(self) -> Sequence[int]:
        return self.tokens[self.prompt_len :]


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """``log_softmax`` of each row in float64 (the max subtracted first, so no overflow)."""
    x = np.asarray(rows, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def token_logprobs(rows: np.ndarray, token_ids: Sequence[int], top: Sequence[int]) -> list[TokenLogprobs]:
    """Raw log-probabilities of ``token_ids[i]`` under ``rows[i]``, with the ``top[i]`` best alternatives."""
    lp = log_softmax(rows)
    n_rows = lp.shape[0]
    ids = np.asarray(token_ids, dtype=np.int64)
    chosen = lp[np.arange(n_rows), ids]
    ranks = (lp > chosen[:, None]).sum(axis=1) + 1
    # a tie with a lower id ranks first, as in a stable descending sort
    ranks += ((lp == chosen[:, None]) & (np.arange(lp.shape[1]) < ids[:, None])).sum(axis=1)
    k = max(top, default=0)
    best_ids = np.zeros((n_rows, 0), np.int64)
    if k:
        k = min(k, lp.shape[1])
        part = np.argpartition(-lp, k - 1, axis=1)[:, :k]
        vals = np.take_along_axis(lp, part, axis=1)
        order = np.lexsort((part, -vals), axis=1)  # by value descending, then id ascending
        best_ids = np.take_along_axis(part, order, axis=1)
    best = lp[np.arange(n_rows)[:, None], best_ids].astype(np.float32)
    chosen32 = chosen.astype(np.float32)
    return [
        TokenLogprobs(
            int(ids[i]),
            float(chosen32[i]),
            int(ranks[i]),
            tuple(zip(best_ids[i, : top[i]].tolist(), best[i, : top[i]].tolist(), strict=True)),
        )
        for i in range(n_rows)
    ]


def process_logits(logits: np.ndarray, rows: Sequence[RowContext]) -> np.ndarray:
    """``logits`` (float32 ``[n, vocab]``) after bias, penalties and masks; the input is not modified.

    Rows whose request sets none of them are left as they are; a step with no such row costs no copy.
    """
    x = np.asarray(logits, dtype=np.float32)
    vocab = x.shape[1]
    copied = False

    def writable() -> np.ndarray:
        nonlocal x, copied
        if not copied:
            x, copied = x.copy(), True
        return x

    # logit_bias: one scatter-add over every biased (row, token) pair (each pair once: a request's ids are unique)
    biased = [i for i, r in enumerate(rows) if r.params.logit_bias]
    if biased:
        r_idx = np.repeat(biased, [len(rows[i].params.logit_bias) for i in biased])
        t_idx = np.concatenate([rows[i].params._bias_ids for i in biased])
        vals = np.concatenate([rows[i].params._bias_values for i in biased])
        keep = t_idx < vocab
        writable()[r_idx[keep], t_idx[keep]] += vals[keep]

    # repetition penalty (prompt + output, vLLM / CTRL): positive logits divided, negative multiplied
    rep = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if rep:
        seen = _token_counts(vocab, [rows[i].tokens for i in rep]) > 0
        penalty = np.array([rows[i].params.repetition_penalty for i in rep], np.float32)[:, None]
        sub = writable()[rep]
        sub = np.where(seen, np.where(sub > 0, sub / penalty, sub * penalty), sub)
        x[rep] = sub

    # frequency and presence penalties (OpenAI): over the generated tokens only
    freq = [i for i, r in enumerate(rows) if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
    if freq:
        counts = _token_counts(vocab, [rows[i].output for i in freq])
        f = np.array([rows[i].params.frequency_penalty for i in freq], np.float32)[:, None]
        p = np.array([rows[i].params.presence_penalty for i in freq], np.float32)[:, None]
        writable()[freq] -= f * counts + p * (counts > 0)

    # min_tokens: the stop tokens (EOS among them) cannot come before the request has that many tokens
    early = [i for i, r in enumerate(rows) if r.params.stop_token_ids and len(r.output) < r.params.min_tokens]
    if early:
        r_idx = np.concatenate([np.full(len(rows[i].params.stop_token_ids), i) for i in early])
        t_idx = np.concatenate([np.asarray(rows[i].params.stop_token_ids, np.int64) for i in early])
        keep = t_idx < vocab
        writable()[r_idx[keep], t_idx[keep]] = -np.inf

    # --- token constraints (structured output, forced tool calls) -----------------------------------------
    # A request's constraint allows a set of next tokens: its mask is stacked with the others' and everything
    # outside it is -inf. A row whose mask allows nothing is left -inf everywhere; the engine ends it.
    constrained = [i for i, r in enumerate(rows) if getattr(r.params, "constraint", None) is not None]
    if constrained:
        masks = np.stack([np.asarray(rows[i].params.constraint.allowed_mask(vocab), bool) for i in constrained])
        if masks.shape != (len(constrained), vocab):
            raise ValueError(f"a TokenConstraint's allowed_mask must be bool [{vocab}], found shape {masks.shape[1:]}")
        sub = writable()[constrained]
        x[constrained] = np.where(masks, sub, -np.inf)
    return x


def _token_counts(vocab: int, sequences: Sequence[Sequence[int]]) -> np.ndarray:
    """``[len(sequences), vocab]`` occurrences of each token id (ids past the vocabulary are not counted)."""
    lengths = [len(s) for s in sequences]
    t_idx = np.fromiter(itertools.chain.from_iterable(sequences), np.int64, sum(lengths))
    flat = np.repeat(np.arange(len(sequences), dtype=np.int64) * vocab, lengths) + t_idx
    flat = flat[(t_idx >= 0) & (t_idx < vocab)]
    counts = np.bincount(flat, minlength=len(sequences) * vocab)
    return counts.reshape(len(sequences), vocab).astype(np.float32)
