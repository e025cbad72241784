"""The packed step's paged inputs and the per-token index arithmetic every pass shares (a leaf module).

:class:`PagedIO` holds the paged graph inputs (built by :func:`ortpa.rewriter.paged_io.begin`) and the subgraphs
derived from them once per graph: the sequence owning each packed token (:func:`sequence_of_token`), the
positions (:func:`positions`), each token's index inside its own sequence's new tokens
(:func:`index_in_sequence`) and each sequence's first / last packed token. Both
:mod:`ortpa.rewriter.paged_io` and the per-sequence pass (:mod:`ortpa.rewriter.per_sequence`) import it; it
imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import Builder
from ortpa.rewriter.layer import PagedAttentionInputs

__all__ = [
    "PagedIO",
    "TokenSequence",
    "index_in_sequence",
    "last_token_index",
    "positions",
    "sequence_bounds",
    "sequence_of_token",
    "token_index",
    "total_length",
]


@dataclass(frozen=True)
class TokenSequence:
    """``seq [T]`` int64: the sequence owning each packed token; ``onehot [T, B]``: ``seq[t] == s``."""

    seq: ir.Value
    onehot: ir.Value


@dataclass
class PagedIO:
    """The paged graph inputs, plus the dense I/O they replace (removed by ``paged_io.finish``)."""

    input_ids: ir.Value
    cumulative_sequence_lengths: ir.Value
    past_sequence_lengths: ir.Value
    block_table: ir.Value
    attention_metadata: ir.Value | None
    position_ids: ir.Value | None  # graph input when PositionMode == "input"
    dense_inputs: dict[str, ir.Value] = field(default_factory=dict)
    dense_outputs: dict[str, ir.Value] = field(default_factory=dict)
    cos_cache: ir.Value | None = None
    sin_cache: ir.Value | None = None
    derived_positions: ir.Value | None = None  # built once by :func:`positions` (PositionMode "derive")
    # built once per graph, on first use, by the functions below
    token_sequence: TokenSequence | None = None
    bounds: tuple[ir.Value, ir.Value] | None = None  # (starts [B], ends [B]) int64 from cumulative lengths
    token_index: ir.Value | None = None  # [T] int64: 0, 1, ... over all packed tokens
    index_in_seq: ir.Value | None = None
    # values the per-sequence pass built, per token: value -> (rank, token axis)
    per_token: dict[ir.Value, tuple[int, int]] = field(default_factory=dict)
    total_len: ir.Value | None = None  # [T] int64: past + new tokens of each token's own sequence
    rope_tables: dict = field(default_factory=dict)  # per-token cos/sin, built once per table choice and dtype
    dense_nodes: frozenset = frozenset()  # the dense graph's own nodes (before any rewrite), for the dataflow

    def op_inputs(self) -> PagedAttentionInputs:
        return PagedAttentionInputs(
            cumulative_sequence_length=self.cumulative_sequence_lengths,
            past_seqlens=self.past_sequence_lengths,
            block_table=self.block_table,
            attention_metadata=self.attention_metadata,
            cos_cache=self.cos_cache,
            sin_cache=self.sin_cache,
        )

    def seeds(self) -> dict[ir.Value, tuple[int, int]]:
        """Per-token values built here or by the per-sequence pass: value -> (rank, token axis)."""
        out = [self.input_ids, self.position_ids, self.derived_positions, self.index_in_seq, self.total_len]
        if self.token_sequence is not None:
            out.append(self.token_sequence.seq)
        return {**{v: (1, 0) for v in out if v is not None}, **self.per_token}


def _int(b: Builder, value: int, hint: str) -> ir.Value:
    return b.initializer(np.array(value, np.int64), hint)


def token_index(b: Builder, io: PagedIO) -> ir.Value:
    """``[T]`` int64: 0, 1, ... over all packed tokens (built once)."""
    if io.token_index is None:
        count = b.op("Squeeze", [b.op("Shape", [io.input_ids])])
        io.token_index = b.op("Range", [_int(b, 0, "zero"), count, _int(b, 1, "one")], hint="token_index")
    return io.token_index


def sequence_bounds(b: Builder, io: PagedIO) -> tuple[ir.Value, ir.Value]:
    """``(starts, ends)`` ``[B]`` int64: each sequence's packed tokens are ``starts[s] <= t < ends[s]``."""
    if io.bounds is None:
        cu = b.op("Cast", [io.cumulative_sequence_lengths], {"to": ir.DataType.INT64})
        ends = b.op("Slice", [cu, b.ints([1]), b.ints([np.iinfo(np.int64).max])], hint="sequence_ends")
        starts = b.op("Slice", [cu, b.ints([0]), b.ints([-1])], hint="sequence_starts")
        io.bounds = (starts, ends)
    return io.bounds


def sequence_of_token(b: Builder, io: PagedIO) -> TokenSequence:
    """The sequence owning each packed token, built once per graph: seq(t) = #{s : cu[s+1] <= t}.

    A ``[T, B]`` comparison, fine for the batch sizes a step carries.
    """
    if io.token_sequence is None:
        t = token_index(b, io)
        _, ends = sequence_bounds(b, io)
        le = b.op("LessOrEqual", [b.op("Unsqueeze", [ends, b.ints([0])]), b.op("Unsqueeze", [t, b.ints([1])])])
        seq = b.op(
            "ReduceSum", [b.op("Cast", [le], {"to": ir.DataType.INT64}), b.ints([1])], {"keepdims": 0}, hint="seq"
        )
        batch = b.op("Squeeze", [b.op("Shape", [io.past_sequence_lengths])])
        sequences = b.op("Range", [_int(b, 0, "zero"), batch, _int(b, 1, "one")])
        onehot = b.op("Equal", [b.op("Unsqueeze", [seq, b.ints([1])]), b.op("Unsqueeze", [sequences, b.ints([0])])])
        io.token_sequence = TokenSequence(seq, onehot)
    return io.token_sequence


def index_in_sequence(b: Builder, io: PagedIO) -> ir.Value:
    """``[T]`` int64: token t's index among its own sequence's new tokens (``t - starts[seq(t)]``): what
    ``Range(0, seq_len, 1)`` gives that sequence run alone."""
    if io.index_in_seq is None:
        starts, _ = sequence_bounds(b, io)
        seq = sequence_of_token(b, io).seq
        io.index_in_seq = b.op("Sub", [token_index(b, io), b.op("Gather", [starts, seq])], hint="index_in_sequence")
    return io.index_in_seq


def positions(b: Builder, io: PagedIO) -> ir.Value:
    """Per-token positions ``[num_tokens]`` int64: the ``position_ids`` input, else derived once in-graph.

    pos[t] = past[s] + t - cu[s] where s is the sequence owning packed token t (no runtime help needed).
    """
    if io.position_ids is not None:
        return io.position_ids
    if io.derived_positions is None:
        past = b.op("Cast", [io.past_sequence_lengths], {"to": ir.DataType.INT64})
        offset = b.op("Gather", [past, sequence_of_token(b, io).seq])
        io.derived_positions = b.op("Add", [index_in_sequence(b, io), offset], hint="position_ids")
    return io.derived_positions


def last_token_index(b: Builder, io: PagedIO) -> ir.Value:
    """``[B]`` int64: each sequence's last packed token."""
    _, ends = sequence_bounds(b, io)
    return b.op("Sub", [ends, _int(b, 1, "one")], hint="last_token_index")


def total_length(b: Builder, io: PagedIO) -> ir.Value:
    """``[T]`` int64: each token's own sequence's total length this step (past + its new tokens), i.e. the
    ``total_sequence_length`` that sequence's step has run alone."""
    if io.total_len is None:
        starts, ends = sequence_bounds(b, io)
        past = b.op("Cast", [io.past_sequence_lengths], {"to": ir.DataType.INT64})
        totals = b.op("Add", [past, b.op("Sub", [ends, starts])])
        io.total_len = b.op("Gather", [totals, sequence_of_token(b, io).seq], hint="total_length")
    return io.total_len
