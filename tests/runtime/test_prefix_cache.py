"""ortpa.runtime.prefix_cache: hash chains, hits checked against tokens, LRU eviction of unused blocks."""

from __future__ import annotations

from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.prefix_cache import (
    ROOT_HASH,
    CacheHolder,
    PrefixCache,
    extend_block_hashes,
    hash_block_tokens,
)

BS = 2


def _cached_sequence(kv: PagedKVCache, pc: PrefixCache, seq_id: str, tokens: list[int]) -> list:
    """A sequence whose full blocks are computed and offered to the cache; returns its hash chain."""
    kv.add_sequence(seq_id)
    kv.append(seq_id, len(tokens))
    hashes: list = []
    extend_block_hashes(hashes, tokens, BS, len(tokens) // BS)
    for i, (h, b) in enumerate(zip(hashes, kv.block_ids(seq_id), strict=False)):
        assert pc.insert(h, b, tokens[i * BS : (i + 1) * BS])
    return hashes


def test_hash_chain_depends_on_the_whole_prefix():
    a = hash_block_tokens(ROOT_HASH, [1, 2])
    assert a == hash_block_tokens(ROOT_HASH, [1, 2])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(hash_block_tokens(ROOT_HASH, [9, 9]), [3, 4])
    chain: list = []
    extend_block_hashes(chain, [1, 2, 3, 4, 5], BS, 2)
    assert chain == [a, hash_block_tokens(a, [3, 4])]


def test_match_insert_and_holder_references():
    kv = PagedKVCache(8, BS)
    pc = PrefixCache(kv)
    hashes = _cached_sequence(kv, pc, "a", [1, 2, 3, 4, 5])
    blocks = kv.block_ids("a")
    assert len(pc) == 2 and pc.num_evictable() == 0  # "a" still reads both
    assert pc.match(hashes, [1, 2, 3, 4]) == blocks[:2]
    assert pc.match(hashes, [1, 2, 3, 9]) == blocks[:1]  # same hash, other tokens: not a hit
    assert not pc.insert(hashes[0], blocks[2], [1, 2])  # already cached
    kv.free("a")
    assert pc.num_evictable() == 2 and kv.num_free_blocks == 8 - 2
    kv.add_sequence("b", 2 * BS, shared_blocks=pc.match(hashes, [1, 2, 3, 4]))
    assert pc.num_evictable() == 0
    kv.check_invariants()


def test_eviction_is_lru_and_tail_first_and_skips_blocks_in_use():
    kv = PagedKVCache(8, BS)
    pc = PrefixCache(kv)
    ha = _cached_sequence(kv, pc, "a", [1, 2, 3, 4])
    hb = _cached_sequence(kv, pc, "b", [5, 6])
    a_blocks, b_block = kv.block_ids("a"), kv.block_ids("b")[0]
    kv.free("a")
    pc.release(ha)  # a's chain: tail refreshed first, so the tail is older than the head
    assert pc.evict(1) == 1
    assert ha[1] not in pc and ha[0] in pc and kv.pool.ref_count(a_blocks[1]) == 0
    assert pc.evict(5) == 1  # a's head; b's block is still read by "b"
    assert ha[0] not in pc and hb[0] in pc and kv.pool.ref_count(b_block) == 2
    kv.free("b")
    pc.clear()
    assert kv.num_free_blocks == 8 and len(kv) == 0 and CacheHolder(b_block) not in kv
    assert pc.num_evictions == 2
    kv.check_invariants()
