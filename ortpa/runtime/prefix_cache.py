"""Prefix caching of full KV blocks over :class:`~ortpa.runtime.kv.PagedKVCache`'s public API.

A full block is identified by a hash chain over token ids — ``hash(parent_hash, tokens of the block)`` — so
equal hashes mean equal *prefixes*, not just equal blocks (vLLM's ``hash_block_tokens``). The cache maps
hash → block id; a request whose prompt starts with cached blocks adopts them through
``PagedKVCache.add_sequence(..., shared_blocks=...)`` and computes only the rest.

Keeping a block alive after its last request is gone needs a reference the pool counts. kv.py's pool returns
a block to its free queue when its ref count reaches zero, and ``add_sequence`` only shares allocated blocks,
so the cache holds one reference of its own per block: a one-block *holder sequence* ``CacheHolder(block)``.
This keeps kv.py's invariant "a block's ref count is the number of sequences holding it" true, and needs no
change to kv.py.

Invariants:

1. every entry's block is held by its ``CacheHolder`` (ref count >= 1), and each block has at most one entry;
2. an entry is *evictable* when its ref count is exactly 1 (only the holder): no request reads it;
3. eviction order is least recently used first (:meth:`PrefixCache.touch` and :meth:`PrefixCache.release`
   refresh entries; ``release`` walks a finished request's blocks tail first, so a chain's tail is evicted
   before its head, as vLLM does: the head is the part more requests share).
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

from ortpa.runtime.kv import PagedKVCache

__all__ = ["ROOT_HASH", "BlockHash", "CacheHolder", "PrefixCache", "extend_block_hashes", "hash_block_tokens"]

# A distinct type so that a block id or a token tuple is never mistaken for a hash.
BlockHash = NewType("BlockHash", bytes)
ROOT_HASH = BlockHash(b"ortpa-prefix-root")  # the parent of every sequence's first block


def hash_block_tokens(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    """The chained hash of one full block: 128-bit BLAKE2b of the parent hash and the block's int64 token ids."""
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return BlockHash(h.digest())


def extend_block_hashes(hashes: list[BlockHash], tokens: Sequence[int], block_size: int, num_blocks: int) -> None:
    """Grow ``hashes`` in place to the first ``num_blocks`` full blocks of ``tokens`` (no-op if already there)."""
    while len(hashes) < num_blocks:
        i = len(hashes)
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size]))


@dataclass(frozen=True)
class CacheHolder:
    """The sequence id under which the prefix cache holds its own reference on ``block``."""

    block: int


@dataclass(slots=True)
class _Entry:
    block: int  # the block id holding these tokens' K/V
    tokens: tuple[int, ...]  # the block's token ids: a hash hit is checked against them (as nano-vllm does)


class PrefixCache:
    """hash → block map with LRU eviction of blocks no request uses (see the module docstring)."""

    def __init__(self, kv: PagedKVCache) -> None:
        self.kv = kv
        self._entries: dict[BlockHash, _Entry] = {}
        self._lru: collections.OrderedDict[BlockHash, None] = collections.OrderedDict()  # oldest first
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def match(self, hashes: Sequence[BlockHash], tokens: Sequence[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (``tokens`` are the sequence's token ids)."""
        bs = self.kv.block_size
        blocks: list[int] = []
        for i, h in enumerate(hashes):
            entry = self._entries.get(h)
            if entry is None or entry.tokens != tuple(tokens[i * bs : (i + 1) * bs]):
                break
            blocks.append(entry.block)
        return blocks

    def touch(self, hashes: Iterable[BlockHash]) -> None:
        """Mark entries as just used (most recent last)."""
        for h in hashes:
            if h in self._lru:
                self._lru.move_to_end(h)

    def release(self, hashes: Sequence[BlockHash]) -> None:
        """A request holding these leading blocks is done with them: refresh them tail first (see invariant 3)."""
        self.touch(reversed(hashes))

    def insert(self, block_hash: BlockHash, block: int, tokens: Sequence[int]) -> bool:
        """Cache ``block`` (full, already computed) under ``block_hash``; False if that hash is cached already."""
        if block_hash in self._entries:
            return False  # computed twice (two requests prefilled the same prefix in one step): keep the first
        self.kv.add_sequence(CacheHolder(block), num_tokens=self.kv.block_size, shared_blocks=[block])
        self._entries[block_hash] = _Entry(block, tuple(int(t) for t in tokens))
        self._lru[block_hash] = None
        return True

    def num_evictable(self) -> int:
        """Cached blocks only the cache holds: the pool can have them back on demand."""
        refs = self.kv.pool.ref_count
        return sum(1 for e in self._entries.values() if refs(e.block) == 1)

    def evict(self, n: int) -> int:
        """Return up to ``n`` evictable blocks to the pool, least recently used first; the number returned."""
        refs = self.kv.pool.ref_count
        victims = []
        for h in self._lru:
            if len(victims) == n:
                break
            if refs(self._entries[h].block) == 1:
                victims.append(h)
        for h in victims:
            self._drop(h)
        self.num_evictions += len(victims)
        return len(victims)

    def clear(self) -> None:
        """Forget every entry; blocks a request still reads stay with that request."""
        for h in list(self._entries):
            self._drop(h)

    def _drop(self, block_hash: BlockHash) -> None:
        entry = self._entries.pop(block_hash)
        del self._lru[block_hash]
        self.kv.free(CacheHolder(entry.block))
