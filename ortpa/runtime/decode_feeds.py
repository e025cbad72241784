"""The index inputs of all-decode steps, kept in place from step to step instead of rebuilt.

A step in which every scheduled request decodes one token (the steady state of generation) changes its index
inputs in a known way: each sequence's past length and position grow by one, the longest context by one, and a
block table row gains a block only when its sequence crosses a block boundary (or copies a shared partial block
on write). :class:`DecodeFeeds` keeps one preallocated array per converted-model input (docs/converted_model.md)
and updates those arrays in place; :meth:`ortpa.runtime.session.PagedSession.bind_step` binds them to the
session once, so such a step costs no array building and no rebinding. The arrays are made again, and bound
again, only when the batch changes (a request joins, leaves or is preempted), after any step this class did
not plan (a prompt chunk, a mixed step), or when the block table must widen.

Who calls what (:class:`~ortpa.runtime.engine.Engine`): the scheduler's
:meth:`~ortpa.runtime.scheduler.Scheduler.schedule` plans an all-decode step here (through
:meth:`~ortpa.runtime.kv.PagedKVCache.plan_decodes`, the block manager's cheap path) and calls :meth:`reset`
after any other step; the engine writes the step's tokens with :meth:`set_tokens` and runs the bound session.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ortpa.runtime.kv import PagedKVCache, SeqId

__all__ = ["DecodeFeeds"]


class DecodeFeeds:
    """One array per index input of an all-decode step over ``B`` sequences, updated in place.

    ``input_ids`` ``[B]`` int64, ``cumulative_sequence_lengths`` ``[B+1]`` int32 (``0, 1, .., B``),
    ``past_sequence_lengths`` ``[B]`` int32, ``block_table`` ``[B, W]`` int32 padded with -1 (``W`` the widest
    row, as :meth:`~ortpa.runtime.kv.PagedKVCache.plan_step` makes it), and where the model takes them
    ``attention_metadata`` ``[3]`` int32 (max query length 1, max context twice) and ``position_ids`` ``[B]``
    int64: the same values the unbound path feeds, so the two give the same tokens.

    ``layout`` counts array reallocations: a session that bound the arrays of an older layout binds again.
    """

    def __init__(self, *, attention_metadata: bool, position_ids: bool) -> None:
        self._with_metadata = attention_metadata
        self._with_positions = position_ids
        self.seq_ids: tuple[SeqId, ...] = ()  # the batch the arrays describe; () until the first plan
        self.layout = 0
        self.feeds: dict[str, np.ndarray] = {}
        self._past = self._positions = self._metadata = self._table = self._ids = np.zeros(0, np.int32)

    def reset(self) -> None:
        """Forget the batch: a step planned elsewhere changed the sequences, so the next plan rebuilds."""
        self.seq_ids = ()

    def plan(self, kv: PagedKVCache, seq_ids: Sequence[SeqId]) -> None:
        """Commit one token to each sequence of ``kv`` (blocks reserved, :class:`~ortpa.errors.OutOfBlocks` when
        they do not fit, nothing changed then) and bring the arrays to this step."""
        ids = tuple(seq_ids)
        changed = kv.plan_decodes(ids)
        if ids != self.seq_ids:
            self._rebuild(kv, ids)
            return
        # the same batch as the last step, which this class planned: every sequence is one token longer
        self._past += 1
        if self._with_positions:
            self._positions += 1
        if self._with_metadata:
            self._metadata[1:] += 1
        width = self._table.shape[1]
        for row, col, block in changed:
            if col >= width:  # a sequence crossed into a block the table has no column for: widen it
                self._rebuild(kv, ids)
                return
            self._table[row, col] = block

    def set_tokens(self, tokens: Sequence[int]) -> None:
        """The step's input tokens, one per sequence in batch order (each request's last token)."""
        self._ids[:] = tokens

    def _rebuild(self, kv: PagedKVCache, ids: tuple[SeqId, ...]) -> None:
        past = [kv.num_tokens(s) - 1 for s in ids]  # plan_decodes has committed this step's token already
        blocks = [kv.block_ids(s) for s in ids]
        width = max(1, *(len(b) for b in blocks))
        self._ids = np.zeros(len(ids), np.int64)
        self._past = np.array(past, np.int32)
        self._table = np.array([b + [-1] * (width - len(b)) for b in blocks], np.int32)
        self.feeds = {
            "input_ids": self._ids,
            "cumulative_sequence_lengths": np.arange(len(ids) + 1, dtype=np.int32),
            "past_sequence_lengths": self._past,
            "block_table": self._table,
        }
        if self._with_metadata:
            longest = max(past) + 1
            self._metadata = np.array([1, longest, longest], np.int32)
            self.feeds["attention_metadata"] = self._metadata
        if self._with_positions:
            self._positions = np.array(past, np.int64)
            self.feeds["position_ids"] = self._positions
        self.seq_ids = ids
        self.layout += 1
