"""The paged KV cache manager: a block pool, per-sequence block lists, and the op's index tensors.

Nothing here knows about models. A cache tensor is ``[num_blocks, block_size, kv_heads, head_size]`` per
layer (LATENT: one head, no value cache); this module hands out *block ids* into axis 0 of those tensors and
emits the int32 index inputs ``com.microsoft::PagedAttention`` reads for one step.

Three small classes, one job each (the split of vLLM's ``block_pool.py`` / ``kv_cache_manager.py``):

* :class:`BlockPool` — free queue and reference counts; allocate / share / free block ids.
* :class:`KVSequence` — the record of one sequence: id, committed token count, block list.
* :class:`PagedKVCache` — the per-sequence façade: add, append, fork (copy-on-write), free, and
  :meth:`PagedKVCache.plan_step`, which reserves blocks for a step and returns :class:`StepInputs`
  (:meth:`PagedKVCache.plan_decodes`: the same for an all-decode step, returning only the changed table cells).

Token layout of one sequence (``bs`` = block_size, ``n`` = num_tokens)::

    blocks:   | blocks[0] | blocks[1] | ... | blocks[-1]           |
    tokens:   | 0 .. bs-1 | bs .. 2bs-1 | ... | (k-1)bs .. n-1 | free |
    token p lives at slot  blocks[p // bs] * bs + p % bs,  and len(blocks) == ceil(n / bs)

Only the last block can be partial, and appends write only at positions >= n, so full blocks are immutable
once written: sharing them (fork, prefix adoption) needs no copies. A *shared partial* last block is
copied on write: the first append into it gets a fresh block and a pending ``(src, dst)`` copy.

Pool sizing (:func:`bytes_per_block`, :func:`blocks_for_budget`, :func:`blocks_from_device_memory`) and
block copies (:func:`copy_blocks`) live in :mod:`ortpa.runtime.kv_memory` and are re-exported here.

Over ~400 lines on purpose: three small classes with one state machine and its stated invariants, kept
together so that the invariants can be read in one place.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from ortpa.errors import BlockRefError, InvalidSequenceOp, OutOfBlocks, UnknownSequence
from ortpa.runtime.kv_memory import (
    BlockCopier,
    blocks_for_budget,
    blocks_from_device_memory,
    bytes_per_block,
    copy_blocks,
)

__all__ = [
    "BlockCopier",
    "BlockPool",
    "BlockRefError",
    "InvalidSequenceOp",
    "KVSequence",
    "PagedKVCache",
    "SeqId",
    "StepInputs",
    "UnknownSequence",
    "blocks_for_budget",
    "blocks_from_device_memory",
    "bytes_per_block",
    "copy_blocks",
]

SeqId = Hashable


class BlockPool:
    """A fixed set of ``num_blocks`` block ids with a free queue and per-block reference counts.

    Invariants (checked by :meth:`check_invariants`):

    1. every block id in ``[0, num_blocks)`` is either in the free queue exactly once with ref count 0, or
       out of it with ref count >= 1 — never both, never neither;
    2. ``num_free_blocks == len(free queue)``.

    :meth:`allocate` is all-or-nothing. Freed blocks go to the *back* of the queue, so the block freed longest
    ago is reused first; a later prefix cache can evict in that order. There is no reserved "null block" (as
    vLLM has): the op's unmapped sentinel is -1, so every id is a usable block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise InvalidSequenceOp(f"BlockPool: num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._refs = [0] * num_blocks  # ref count per block id; 0 <=> in the free queue

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def ref_count(self, block: int) -> int:
        self._check_id(block, "ref_count")
        return self._refs[block]

    def allocate(self, n: int, what: str = "") -> list[int]:
        """Take ``n`` blocks with ref count 1; raise :class:`OutOfBlocks`, allocating nothing, if fewer are free."""
        if n < 0:
            raise InvalidSequenceOp(f"BlockPool.allocate: n must be >= 0, got {n}")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free), what)
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._refs[b] = 1
        return blocks

    def share(self, blocks: Iterable[int]) -> None:
        """Add one reference to each allocated block (fork, prefix adoption). All-or-nothing."""
        blocks = list(blocks)
        for b in blocks:
            self._check_id(b, "share")
            if self._refs[b] == 0:
                raise BlockRefError(f"BlockPool.share: block {b} is free (expected an allocated block)")
        for b in blocks:
            self._refs[b] += 1

    def free(self, blocks: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 return to the free queue. All-or-nothing.

        A block listed ``k`` times drops ``k`` references, so freeing more references than it holds — a double
        free — raises :class:`BlockRefError` before any count changes.
        """
        drops = collections.Counter(blocks)
        for b, k in drops.items():
            self._check_id(b, "free")
            if k > self._refs[b]:
                raise BlockRefError(
                    f"BlockPool.free: block {b} freed {k} time(s) but holds {self._refs[b]} reference(s) (double free)"
                )
        for b, k in drops.items():
            self._refs[b] -= k
            if self._refs[b] == 0:
                self._free.append(b)

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` naming the first broken invariant (see the class docstring)."""
        free = list(self._free)
        assert len(set(free)) == len(free), f"free queue holds duplicates: {sorted(free)}"
        in_queue = set(free)
        for b, r in enumerate(self._refs):
            assert r >= 0, f"block {b} has negative ref count {r}"
            assert (r == 0) == (b in in_queue), f"block {b}: ref count {r} but in free queue = {b in in_queue}"

    def _check_id(self, block: int, where: str) -> None:
        if not 0 <= block < self.num_blocks:
            raise BlockRefError(f"BlockPool.{where}: block id {block} out of range [0, {self.num_blocks})")


@dataclass(slots=True)
class KVSequence:
    """One sequence's share of the cache. Invariant: ``len(blocks) == ceil(num_tokens / block_size)``."""

    seq_id: SeqId
    # Tokens whose K/V is in the cache (or will be, once the step that reserved them has run).
    num_tokens: int = 0
    # Block ids in token order; token p lives in blocks[p // block_size].
    blocks: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepInputs:
    """The index inputs of one PagedAttention step, for ``B`` sequences and ``T`` packed new tokens.

    All int32 except ``positions`` / ``last_token_indices`` (int64, as ``position_ids`` and numpy gathers
    want). ``attention_metadata`` belongs in host memory (bind it with ``bind_cpu_input``).
    """

    seq_ids: tuple[SeqId, ...]
    cumulative_sequence_length: np.ndarray  # [B+1] int32: 0, q0, q0+q1, ...
    past_seqlens: np.ndarray  # [B] int32: committed tokens before this step
    block_table: np.ndarray  # [B, max_blocks] int32, rows padded with -1 (unmapped)
    slot_mapping: np.ndarray  # [T] int32: block_id * block_size + offset of each new token
    attention_metadata: np.ndarray  # [3] int32: max query len, max kv len, max kv len (exact, so also the lower bound)
    positions: np.ndarray  # [T] int64: past + i for the i-th new token of its sequence
    last_token_indices: np.ndarray  # [B] int64: packed row of each sequence's last new token, -1 if it has none

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def model_feeds(self, input_ids: np.ndarray, *, attention_metadata: bool, position_ids: bool) -> dict:
        """The feeds of a converted model's step (docs/converted_model.md): the packed ``input_ids`` and these index
        tensors under the model's input names; ``attention_metadata`` / ``position_ids`` where the model takes
        them."""
        feeds = {
            "input_ids": input_ids,
            "cumulative_sequence_lengths": self.cumulative_sequence_length,
            "past_sequence_lengths": self.past_seqlens,
            "block_table": self.block_table,
        }
        if attention_metadata:
            feeds["attention_metadata"] = self.attention_metadata
        if position_ids:
            feeds["position_ids"] = self.positions
        return feeds


class PagedKVCache:
    """Per-sequence block lists over one :class:`BlockPool`, and the index tensors for each step.

    Every mutating call is all-or-nothing: on any error (:class:`OutOfBlocks`, :class:`UnknownSequence`,
    :class:`InvalidSequenceOp`) the pool, the sequences and the pending copies are unchanged.

    Copy-on-write: appending to a sequence whose last block is partial and shared (ref count > 1) first moves
    the sequence to a fresh block and records ``(src, dst)``. The runtime must run every copy returned by
    :meth:`take_pending_copies`, in order, on every cache tensor, after the previous step and before the step
    whose inputs were planned — order matters, since a later copy may read a block an earlier one wrote.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise InvalidSequenceOp(f"PagedKVCache: block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._seqs: dict[SeqId, KVSequence] = {}
        self._pending_copies: list[tuple[int, int]] = []

    # -- queries -------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def seq_ids(self) -> list[SeqId]:
        return list(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def sequence(self, seq_id: SeqId) -> KVSequence:
        """A snapshot (copy) of the sequence's record; mutating it does not touch the cache."""
        s = self._get(seq_id, "sequence")
        return KVSequence(s.seq_id, s.num_tokens, list(s.blocks))

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._get(seq_id, "num_tokens").num_tokens

    def block_ids(self, seq_id: SeqId) -> list[int]:
        return list(self._get(seq_id, "block_ids").blocks)

    def blocks_needed(self, seq_id: SeqId, n: int) -> int:
        """Blocks ``append(seq_id, n)`` would take from the pool (new blocks plus a copy-on-write block)."""
        return self._needed(self._get(seq_id, "blocks_needed"), n, self.pool.ref_count)

    def can_append(self, seq_id: SeqId, n: int) -> bool:
        return self.blocks_needed(seq_id, n) <= self.pool.num_free_blocks

    def slots(self, seq_id: SeqId, start: int, stop: int) -> np.ndarray:
        """int32 slots of token positions ``[start, stop)`` of a sequence (all must be committed)."""
        s = self._get(seq_id, "slots")
        if not 0 <= start <= stop <= s.num_tokens:
            raise InvalidSequenceOp(
                f"slots({seq_id!r}): expected 0 <= start <= stop <= {s.num_tokens}, got [{start}, {stop})"
            )
        return self._slots(s, start, stop)

    # -- lifecycle -----------------------------------------------------------------------------------
    def add_sequence(self, seq_id: SeqId, num_tokens: int = 0, shared_blocks: Sequence[int] = ()) -> KVSequence:
        """Start a sequence holding ``num_tokens`` committed tokens.

        ``shared_blocks`` is the prefix-cache hook: the sequence adopts those blocks (one more reference each)
        as its first blocks, and gets fresh blocks for the rest of ``ceil(num_tokens / block_size)``. Adopted
        blocks are read-only to it: if the last one is partial and still shared, the first append copies it.
        The caller writes the K/V of tokens past the adopted blocks (see :meth:`slots`); tokens inside them
        must already be there, so only a prefix ending on a block boundary can be extended this way.
        """
        if seq_id in self._seqs:
            raise InvalidSequenceOp(f"add_sequence: sequence {seq_id!r} already exists")
        if num_tokens < 0:
            raise InvalidSequenceOp(f"add_sequence({seq_id!r}): num_tokens must be >= 0, got {num_tokens}")
        total = -(-num_tokens // self.block_size)
        shared = list(shared_blocks)
        if len(shared) > total:
            raise InvalidSequenceOp(
                f"add_sequence({seq_id!r}): {num_tokens} tokens fill {total} block(s) of {self.block_size}, "
                f"but {len(shared)} shared blocks were given"
            )
        if len(set(shared)) != len(shared):
            raise InvalidSequenceOp(f"add_sequence({seq_id!r}): shared_blocks repeats a block: {shared}")
        for b in shared:  # validate before allocating, so a bad id leaves the pool untouched
            if not 0 <= b < self.num_blocks or self.pool.ref_count(b) == 0:
                raise BlockRefError(f"add_sequence({seq_id!r}): shared block {b} is not an allocated block")
        fresh = self.pool.allocate(total - len(shared), what=f"sequence {seq_id!r}")
        self.pool.share(shared)  # cannot fail now: every id was checked above
        self._seqs[seq_id] = KVSequence(seq_id, num_tokens, shared + fresh)
        return self.sequence(seq_id)

    def append(self, seq_id: SeqId, n: int) -> np.ndarray:
        """Commit ``n`` more tokens, reserving blocks; return the int32 slots the new tokens go to."""
        seq = self._get(seq_id, "append")
        need = self._needed(seq, n, self.pool.ref_count)
        if need > self.pool.num_free_blocks:
            raise OutOfBlocks(need, self.pool.num_free_blocks, f"sequence {seq_id!r}")
        start = seq.num_tokens
        self._grow(seq, n)
        return self._slots(seq, start, seq.num_tokens)

    def fork(self, parent: SeqId, child: SeqId) -> KVSequence:
        """Make ``child`` a copy of ``parent`` that shares every block by reference (no allocation)."""
        p = self._get(parent, "fork")
        if child in self._seqs:
            raise InvalidSequenceOp(f"fork({parent!r} -> {child!r}): sequence {child!r} already exists")
        self.pool.share(p.blocks)
        self._seqs[child] = KVSequence(child, p.num_tokens, list(p.blocks))
        return self.sequence(child)

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence and one reference to each of its blocks."""
        seq = self._get(seq_id, "free")
        # Tail first, as vLLM does: the tail blocks are the least likely to be shared by a later prefix hit.
        self.pool.free(reversed(seq.blocks))
        del self._seqs[seq_id]

    def take_pending_copies(self) -> list[tuple[int, int]]:
        """Return and clear the ``(src, dst)`` block copies recorded since the last call, in order."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def check_invariants(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of sequences holding it."""
        self.pool.check_invariants()
        holders = collections.Counter(b for s in self._seqs.values() for b in s.blocks)
        for s in self._seqs.values():
            want = -(-s.num_tokens // self.block_size)
            assert len(s.blocks) == want, f"sequence {s.seq_id!r}: {len(s.blocks)} blocks for {s.num_tokens} tokens"
        for b in range(self.num_blocks):
            refs = self.pool.ref_count(b)
            assert refs == holders[b], f"block {b}: ref count {refs}, held by {holders[b]} sequence(s)"

    # -- one step ------------------------------------------------------------------------------------
    def plan_step(self, schedule: Sequence[tuple[SeqId, int]], block_table_width: int | None = None) -> StepInputs:
        """Reserve blocks for this step's new tokens and return the op's index inputs.

        ``schedule`` is the ordered batch ``[(seq_id, num_new_tokens), ...]``; a sequence's past length is its
        committed count before the call. For the whole batch at once, and all-or-nothing: blocks are reserved
        (with copy-on-write where needed) and each sequence's committed count advances by its new tokens. If
        the pool cannot hold them all, :class:`OutOfBlocks` names the first sequence that does not fit and
        nothing changes. Run :meth:`take_pending_copies` before running the step.

        ``block_table_width`` fixes ``block_table``'s second dimension (constant shapes, e.g. for CUDA graphs);
        by default it is the longest block list in the batch, and at least 1 (the op rejects width 0).
        """
        if not schedule:
            raise InvalidSequenceOp("plan_step: the schedule is empty (expected at least one sequence)")
        seqs: list[KVSequence] = []
        seen: set[SeqId] = set()
        for seq_id, n in schedule:
            seq = self._get(seq_id, "plan_step")
            if n < 0:
                raise InvalidSequenceOp(f"plan_step: sequence {seq_id!r} has num_new_tokens {n} (expected >= 0)")
            if seq_id in seen:
                raise InvalidSequenceOp(f"plan_step: sequence {seq_id!r} is scheduled twice")
            seen.add(seq_id)
            seqs.append(seq)
        news = [n for _, n in schedule]
        self._dry_run(seqs, news)
        width = max(1, *(-(-(s.num_tokens + n) // self.block_size) for s, n in zip(seqs, news, strict=True)))
        if block_table_width is not None:
            if block_table_width < width:
                raise InvalidSequenceOp(
                    f"plan_step: block_table_width {block_table_width} is too narrow (expected >= {width} blocks)"
                )
            width = block_table_width

        past = [s.num_tokens for s in seqs]
        slots: list[int] = []
        for seq, n in zip(seqs, news, strict=True):  # cannot fail now: the dry run reserved enough blocks
            start = seq.num_tokens
            self._grow(seq, n)
            slots += self._slot_list(seq, start, seq.num_tokens)
        return self._emit(seqs, news, past, slots, width)

    def plan_decodes(self, seq_ids: Sequence[SeqId]) -> list[tuple[int, int, int]]:
        """Commit one new token to each sequence (an all-decode step), as ``plan_step`` would, building nothing.

        The cheap path of :meth:`plan_step` for a step where every sequence decodes: blocks are reserved (a new
        block only where a sequence crosses a block boundary, or a copy-on-write block), all-or-nothing, and
        the block table cells that changed are returned as ``(row, column, block id)``, row being the
        sequence's index in ``seq_ids``. The caller keeps the index tensors
        (:class:`~ortpa.runtime.decode_feeds.DecodeFeeds`); run :meth:`take_pending_copies` before the step.
        """
        seqs = [self._get(s, "plan_decodes") for s in seq_ids]
        if len(set(seq_ids)) != len(seqs):
            raise InvalidSequenceOp(f"plan_decodes: a sequence is scheduled twice in {list(seq_ids)}")
        bs, refs = self.block_size, self.pool.ref_count
        need, cow = 0, False
        for s in seqs:
            if s.num_tokens % bs == 0:
                need += 1
            elif refs(s.blocks[-1]) > 1:
                cow = True
        if cow:
            self._dry_run(seqs, [1] * len(seqs))  # copy-on-write: the exact count of plan_step
        elif need > self.pool.num_free_blocks:
            raise OutOfBlocks(need, self.pool.num_free_blocks, f"a decode step of {len(seqs)} sequence(s)")
        changed = []
        for row, seq in enumerate(seqs):  # cannot fail now: enough blocks are free
            if not cow and seq.num_tokens % bs:  # inside its own partial last block: only the count moves
                seq.num_tokens += 1
                continue
            count, last = len(seq.blocks), seq.blocks[-1] if seq.blocks else -1
            self._grow(seq, 1)
            if len(seq.blocks) != count or seq.blocks[-1] != last:
                changed.append((row, len(seq.blocks) - 1, seq.blocks[-1]))
        return changed

    # -- internals -----------------------------------------------------------------------------------
    def _dry_run(self, seqs: list[KVSequence], news: list[int]) -> None:
        """Raise :class:`OutOfBlocks` when appending ``news`` tokens to ``seqs`` would not fit the pool.

        Against a scratch view of the ref counts: copy-on-write by an earlier sequence releases a reference that a
        later sequence sharing the same block then no longer needs to copy.
        """
        released: collections.Counter[int] = collections.Counter()
        need = 0
        for seq, n in zip(seqs, news, strict=True):
            need += self._needed(seq, n, lambda b: self.pool.ref_count(b) - released[b], released)
            if need > self.pool.num_free_blocks:
                raise OutOfBlocks(
                    need,
                    self.pool.num_free_blocks,
                    f"a step of {len(seqs)} sequence(s), reached at sequence {seq.seq_id!r}",
                )

    def _get(self, seq_id: SeqId, where: str) -> KVSequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id, where) from None

    def _needed(
        self, seq: KVSequence, n: int, refs: Callable[[int], int], released: collections.Counter | None = None
    ) -> int:
        """Blocks appending ``n`` tokens takes, given ref counts ``refs``; a copy-on-write is noted in ``released``."""
        if n < 0:
            raise InvalidSequenceOp(f"append: sequence {seq.seq_id!r} got n={n} (expected >= 0)")
        bs = self.block_size
        need = -(-(seq.num_tokens + n) // bs) - len(seq.blocks)
        if n > 0 and seq.num_tokens % bs and refs(seq.blocks[-1]) > 1:
            need += 1  # copy-on-write of the shared partial last block
            if released is not None:
                released[seq.blocks[-1]] += 1
        return need

    def _grow(self, seq: KVSequence, n: int) -> None:
        """Append ``n`` tokens; the caller has checked that the pool holds :meth:`_needed` blocks."""
        bs = self.block_size
        if n > 0 and seq.num_tokens % bs and self.pool.ref_count(seq.blocks[-1]) > 1:
            src = seq.blocks[-1]
            (dst,) = self.pool.allocate(1, what=f"copy-on-write for sequence {seq.seq_id!r}")
            self.pool.free([src])  # drops our reference only; the other holders keep theirs
            seq.blocks[-1] = dst
            self._pending_copies.append((src, dst))
        seq.num_tokens += n
        more = -(-seq.num_tokens // bs) - len(seq.blocks)
        if more:  # most decode steps stay inside the last block
            seq.blocks += self.pool.allocate(more, what=f"sequence {seq.seq_id!r}")

    def _slots(self, seq: KVSequence, start: int, stop: int) -> np.ndarray:
        return np.array(self._slot_list(seq, start, stop), dtype=np.int32)

    def _slot_list(self, seq: KVSequence, start: int, stop: int) -> list[int]:
        bs, blocks = self.block_size, seq.blocks
        return [blocks[p // bs] * bs + p % bs for p in range(start, stop)]

    def _emit(self, seqs, news: list[int], past: list[int], slots: list[int], width: int) -> StepInputs:
        # Python lists first, one array each at the end: a step's host work is a few small arrays, and on a
        # CPU whose caches the model's weights just flushed every numpy call costs ~10x its warm time
        cum = [0]
        for n in news:
            cum.append(cum[-1] + n)
        table = [s.blocks + [-1] * (width - len(s.blocks)) for s in seqs]
        positions = [p + i for p, n in zip(past, news, strict=True) for i in range(n)]
        last = [c - 1 if n > 0 else -1 for c, n in zip(cum[1:], news, strict=True)]
        kv = max(p + n for p, n in zip(past, news, strict=True))
        return StepInputs(
            seq_ids=tuple(s.seq_id for s in seqs),
            cumulative_sequence_length=np.array(cum, dtype=np.int32),
            past_seqlens=np.array(past, dtype=np.int32),
            block_table=np.array(table, dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int32),
            attention_metadata=np.array([max(news), kv, kv], dtype=np.int32),
            positions=np.array(positions, dtype=np.int64),
            last_token_indices=np.array(last, dtype=np.int64),
        )
