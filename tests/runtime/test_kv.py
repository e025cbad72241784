"""ortpa.runtime.kv: the block pool, per-sequence block lists, copy-on-write and the step's index tensors.

Unit tests pin each operation and error; a hypothesis state machine runs random interleavings against a
model that stores, per slot, which token was written there, and reads every sequence back through the
block table the cache emits.
"""

from __future__ import annotations

import collections
import pickle
import sys
import types

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from ortpa.errors import OrtpaError, OutOfBlocks
from ortpa.runtime.kv import (
    BlockPool,
    BlockRefError,
    InvalidSequenceOp,
    PagedKVCache,
    StepInputs,
    UnknownSequence,
    blocks_for_budget,
    blocks_from_device_memory,
    bytes_per_block,
    copy_blocks,
)
from ortpa.runtime.prefix_cache import CacheHolder, PrefixCache, extend_block_hashes

# --------------------------------------------------------------------------------------------------
# BlockPool


def test_pool_allocates_in_queue_order_with_ref_one():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert [pool.ref_count(b) for b in range(4)] == [1, 1, 1, 0]
    assert pool.num_free_blocks == 1
    pool.check_invariants()


def test_pool_out_of_blocks_allocates_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(OutOfBlocks) as e:
        pool.allocate(2, what="sequence 'x'")
    assert (e.value.requested, e.value.free) == (2, 1)
    assert "sequence 'x'" in str(e.value) and "needed 2, 1 free" in str(e.value)
    assert pool.num_free_blocks == 1 and pool.ref_count(2) == 0
    pool.check_invariants()


def test_pool_free_returns_blocks_to_back_of_queue_at_ref_zero():
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    pool.share([b])
    pool.free([a, b])
    assert pool.ref_count(a) == 0 and pool.ref_count(b) == 1
    assert pool.num_free_blocks == 1
    pool.free([c, b])
    assert pool.allocate(3) == [a, c, b]  # the block freed longest ago comes first
    pool.check_invariants()


def test_pool_double_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(BlockRefError, match=r"block 0 freed 1 time\(s\) but holds 0 reference\(s\) \(double free\)"):
        pool.free([a])
    with pytest.raises(BlockRefError, match="double free"):
        pool.free([b, b])  # within one call too; b must keep its reference
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 2
    pool.check_invariants()


def test_pool_rejects_sharing_free_blocks_and_bad_ids():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    with pytest.raises(BlockRefError, match="block 1 is free"):
        pool.share([a, 1])
    assert pool.ref_count(a) == 1  # all-or-nothing
    with pytest.raises(BlockRefError, match=r"block id 5 out of range \[0, 2\)"):
        pool.free([5])
    with pytest.raises(BlockRefError, match="out of range"):
        pool.ref_count(-1)
    with pytest.raises(InvalidSequenceOp, match="num_blocks must be >= 1, got 0"):
        BlockPool(0)
    with pytest.raises(InvalidSequenceOp, match="n must be >= 0"):
        pool.allocate(-1)


def test_pool_check_invariants_detects_corruption():
    pool = BlockPool(2)
    pool.allocate(1)
    pool._refs[0] = 0  # allocated but claims no reference: neither free nor held
    with pytest.raises(AssertionError, match="block 0: ref count 0 but in free queue = False"):
        pool.check_invariants()
    pool = BlockPool(2)
    pool._free.append(0)
    with pytest.raises(AssertionError, match="duplicates"):
        pool.check_invariants()


# --------------------------------------------------------------------------------------------------
# PagedKVCache: lifecycle


def test_add_sequence_allocates_ceil_blocks_and_rejects_misuse():
    cache = PagedKVCache(num_blocks=4, block_size=4)
    seq = cache.add_sequence("a", num_tokens=5)
    assert (seq.seq_id, seq.num_tokens, seq.blocks) == ("a", 5, [0, 1])
    assert cache.add_sequence("b").blocks == []
    assert "a" in cache and len(cache) == 2 and cache.seq_ids == ["a", "b"]
    with pytest.raises(InvalidSequenceOp, match="sequence 'a' already exists"):
        cache.add_sequence("a")
    with pytest.raises(InvalidSequenceOp, match="num_tokens must be >= 0, got -1"):
        cache.add_sequence("c", num_tokens=-1)
    with pytest.raises(OutOfBlocks, match="sequence 'c': needed 3, 2 free"):
        cache.add_sequence("c", num_tokens=9)
    assert "c" not in cache and cache.num_free_blocks == 2
    cache.check_invariants()


def test_sequence_returns_a_snapshot():
    cache = PagedKVCache(4, 2)
    cache.add_sequence(1, num_tokens=3)
    snap = cache.sequence(1)
    snap.blocks.append(3)
    snap.num_tokens = 99
    assert cache.block_ids(1) == [0, 1] and cache.num_tokens(1) == 3


def test_add_sequence_adopts_shared_blocks_for_a_prefix():
    cache = PagedKVCache(num_blocks=6, block_size=2)
    cache.add_sequence("donor", num_tokens=5)  # blocks 0 1 2
    seq = cache.add_sequence("hit", num_tokens=6, shared_blocks=[0, 1])
    assert seq.blocks == [0, 1, 3]
    assert [cache.pool.ref_count(b) for b in (0, 1, 2, 3)] == [2, 2, 1, 1]
    cache.check_invariants()
    cache.free("donor")
    assert [cache.pool.ref_count(b) for b in (0, 1, 2)] == [1, 1, 0]
    cache.check_invariants()


def test_add_sequence_shared_blocks_errors_leave_state_unchanged():
    cache = PagedKVCache(num_blocks=3, block_size=2)
    cache.add_sequence("donor", num_tokens=2)  # block 0
    with pytest.raises(InvalidSequenceOp, match=r"3 tokens fill 2 block\(s\) of 2, but 3 shared blocks were given"):
        cache.add_sequence("x", num_tokens=3, shared_blocks=[0, 0, 0])
    with pytest.raises(InvalidSequenceOp, match=r"shared_blocks repeats a block: \[0, 0\]"):
        cache.add_sequence("x", num_tokens=4, shared_blocks=[0, 0])
    with pytest.raises(BlockRefError, match="shared block 2 is not an allocated block"):
        cache.add_sequence("x", num_tokens=4, shared_blocks=[0, 2])
    with pytest.raises(OutOfBlocks, match="needed 3, 2 free"):
        cache.add_sequence("x", num_tokens=8, shared_blocks=[0])
    assert cache.pool.ref_count(0) == 1 and cache.num_free_blocks == 2 and "x" not in cache
    cache.check_invariants()


def test_append_grows_blocks_and_returns_slots():
    cache = PagedKVCache(num_blocks=4, block_size=4)
    cache.add_sequence("a")
    assert cache.append("a", 3).tolist() == [0, 1, 2]
    assert cache.append("a", 3).tolist() == [3, 4, 5]
    assert cache.block_ids("a") == [0, 1] and cache.num_tokens("a") == 6
    assert cache.append("a", 0).dtype == np.int32
    assert cache.slots("a", 2, 6).tolist() == [2, 3, 4, 5]
    with pytest.raises(InvalidSequenceOp, match=r"expected 0 <= start <= stop <= 6, got \[4, 7\)"):
        cache.slots("a", 4, 7)
    with pytest.raises(InvalidSequenceOp, match="n=-1"):
        cache.append("a", -1)
    cache.check_invariants()


def test_append_out_of_blocks_is_all_or_nothing():
    cache = PagedKVCache(num_blocks=3, block_size=2)
    cache.add_sequence("a", num_tokens=1)
    assert cache.blocks_needed("a", 5) == 2 and cache.can_append("a", 5)
    assert cache.blocks_needed("a", 6) == 3 and not cache.can_append("a", 6)
    with pytest.raises(OutOfBlocks, match="sequence 'a': needed 3, 2 free"):
        cache.append("a", 6)
    assert cache.num_tokens("a") == 1 and cache.block_ids("a") == [0] and cache.num_free_blocks == 2
    cache.check_invariants()


def test_unknown_sequence_is_a_keyerror_with_a_clear_message():
    cache = PagedKVCache(2, 2)
    for call in (
        lambda: cache.append("nope", 1),
        lambda: cache.free("nope"),
        lambda: cache.fork("nope", "child"),
        lambda: cache.num_tokens("nope"),
        lambda: cache.can_append("nope", 1),
        lambda: cache.plan_step([("nope", 1)]),
    ):
        with pytest.raises(UnknownSequence) as e:
            call()
        assert isinstance(e.value, KeyError) and isinstance(e.value, OrtpaError)
        assert "unknown sequence 'nope' (expected an id added and not yet freed)" in str(e.value)
        assert not str(e.value).startswith('"')  # not KeyError's repr of the message
    again = pickle.loads(pickle.dumps(UnknownSequence("s", "free")))
    assert str(again) == "free: unknown sequence 's' (expected an id added and not yet freed)"


def test_free_returns_every_block_and_rejects_second_free():
    cache = PagedKVCache(num_blocks=4, block_size=2)
    cache.add_sequence("a", num_tokens=7)
    assert cache.num_free_blocks == 0
    cache.free("a")
    assert cache.num_free_blocks == 4 and "a" not in cache
    with pytest.raises(UnknownSequence):
        cache.free("a")
    cache.check_invariants()


# --------------------------------------------------------------------------------------------------
# fork and copy-on-write


def test_fork_shares_every_block_without_allocating():
    cache = PagedKVCache(num_blocks=4, block_size=2)
    cache.add_sequence("p", num_tokens=3)
    child = cache.fork("p", "c")
    assert child.blocks == [0, 1] and child.num_tokens == 3
    assert cache.pool.ref_count(0) == 2 and cache.pool.ref_count(1) == 2 and cache.num_free_blocks == 2
    with pytest.raises(InvalidSequenceOp, match=r"fork\('p' -> 'c'\): sequence 'c' already exists"):
        cache.fork("p", "c")
    cache.check_invariants()


def test_append_into_shared_partial_block_copies_on_write():
    cache = PagedKVCache(num_blocks=4, block_size=2)
    cache.add_sequence("p", num_tokens=3)  # blocks 0 (full) 1 (partial)
    cache.fork("p", "c")
    assert cache.blocks_needed("c", 1) == 1  # the copy, nothing else
    assert cache.append("c", 1).tolist() == [5]  # block 2, offset 1
    assert cache.block_ids("c") == [0, 2] and cache.block_ids("p") == [0, 1]
    assert cache.take_pending_copies() == [(1, 2)]
    assert cache.take_pending_copies() == []
    assert cache.pool.ref_count(1) == 1  # the parent now owns it alone: it appends in place
    assert cache.append("p", 1).tolist() == [3]
    assert cache.take_pending_copies() == []
    cache.check_invariants()


def test_fork_at_block_boundary_needs_no_copy():
    cache = PagedKVCache(num_blocks=4, block_size=2)
    cache.add_sequence("p", num_tokens=2)
    cache.fork("p", "c")
    assert cache.append("c", 1).tolist() == [2] and cache.append("p", 1).tolist() == [4]
    assert cache.take_pending_copies() == []
    assert cache.pool.ref_count(0) == 2
    cache.check_invariants()


def test_copy_on_write_out_of_blocks_changes_nothing():
    cache = PagedKVCache(num_blocks=2, block_size=2)
    cache.add_sequence("p", num_tokens=3)
    cache.fork("p", "c")
    with pytest.raises(OutOfBlocks, match="needed 1, 0 free"):
        cache.append("c", 1)
    assert cache.block_ids("c") == [0, 1] and cache.take_pending_copies() == []
    cache.append("c", 0)  # zero tokens never copy
    cache.check_invariants()


# --------------------------------------------------------------------------------------------------
# plan_step


def test_plan_step_emits_exact_tensors():
    cache = PagedKVCache(num_blocks=8, block_size=4)
    cache.add_sequence("a")
    s = cache.plan_step([("a", 6)])
    assert isinstance(s, StepInputs) and s.seq_ids == ("a",) and s.num_tokens == 6
    assert s.slot_mapping.tolist() == [0, 1, 2, 3, 4, 5]
    cache.fork("a", "b")
    cache.add_sequence("z")
    s = cache.plan_step([("a", 1), ("z", 0), ("b", 2)])
    assert s.seq_ids == ("a", "z", "b")
    assert s.cumulative_sequence_length.tolist() == [0, 1, 1, 3]
    assert s.past_seqlens.tolist() == [6, 0, 6]
    assert s.block_table.tolist() == [[0, 2], [-1, -1], [0, 1]]  # a copied block 1 to 2; b then owns 1
    assert s.slot_mapping.tolist() == [10, 6, 7]
    assert s.positions.tolist() == [6, 6, 7]
    assert s.last_token_indices.tolist() == [0, -1, 2]
    assert s.attention_metadata.tolist() == [2, 8, 8]
    assert cache.take_pending_copies() == [(1, 2)]
    for name in ("cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping", "attention_metadata"):
        assert getattr(s, name).dtype == np.int32, name
    assert s.positions.dtype == np.int64 and s.last_token_indices.dtype == np.int64
    assert [cache.num_tokens(x) for x in ("a", "z", "b")] == [7, 0, 8]
    cache.check_invariants()


def test_plan_step_fixed_width_and_zero_width_floor():
    cache = PagedKVCache(num_blocks=4, block_size=2)
    cache.add_sequence("a")
    s = cache.plan_step([("a", 0)])
    assert s.block_table.shape == (1, 1) and s.block_table.tolist() == [[-1]]  # the op rejects width 0
    assert s.attention_metadata.tolist() == [0, 0, 0] and s.slot_mapping.shape == (0,)
    s = cache.plan_step([("a", 3)], block_table_width=4)
    assert s.block_table.tolist() == [[0, 1, -1, -1]]
    with pytest.raises(InvalidSequenceOp, match=r"block_table_width 1 is too narrow \(expected >= 2 blocks\)"):
        cache.plan_step([("a", 1)], block_table_width=1)
    assert cache.num_tokens("a") == 3
    cache.check_invariants()


def test_plan_step_rejects_bad_schedules():
    cache = PagedKVCache(num_blocks=4, block_size=2)
    cache.add_sequence("a")
    with pytest.raises(InvalidSequenceOp, match="schedule is empty"):
        cache.plan_step([])
    with pytest.raises(InvalidSequenceOp, match="sequence 'a' is scheduled twice"):
        cache.plan_step([("a", 1), ("a", 1)])
    with pytest.raises(InvalidSequenceOp, match="num_new_tokens -2"):
        cache.plan_step([("a", -2)])
    assert cache.num_tokens("a") == 0 and cache.num_free_blocks == 4


def test_plan_step_out_of_blocks_names_the_sequence_and_reserves_nothing():
    cache = PagedKVCache(num_blocks=4, block_size=2)
    for name in ("a", "b", "c"):
        cache.add_sequence(name)
    with pytest.raises(OutOfBlocks) as e:
        cache.plan_step([("a", 2), ("b", 3), ("c", 3)])
    assert (e.value.requested, e.value.free) == (5, 4)
    assert "a step of 3 sequence(s), reached at sequence 'c'" in str(e.value)
    assert [cache.num_tokens(x) for x in "abc"] == [0, 0, 0] and cache.num_free_blocks == 4
    cache.check_invariants()


def test_plan_step_counts_copy_on_write_once_for_parent_and_child():
    # p and c share a partial block; whoever appends first copies, the other then writes in place. With one
    # free block the batch fits exactly; counting a copy for each would wrongly raise OutOfBlocks.
    cache = PagedKVCache(num_blocks=2, block_size=2)
    cache.add_sequence("p", num_tokens=1)
    cache.fork("p", "c")
    s = cache.plan_step([("p", 1), ("c", 1)])
    assert s.slot_mapping.tolist() == [3, 1]
    assert cache.take_pending_copies() == [(0, 1)]
    assert cache.num_free_blocks == 0
    cache.check_invariants()


# --------------------------------------------------------------------------------------------------
# sizing and block copies


def test_bytes_per_block():
    # SEPARATE fp16: 16 tokens * 8 heads * 128 * 2 bytes, key + value, 32 layers.
    assert bytes_per_block(16, 8, 128, np.float16, 32, True) == 32 * 2 * 16 * 8 * 128 * 2
    assert bytes_per_block(16, 8, 128, "float16", 32, True) == bytes_per_block(16, 8, 128, np.float16, 32, True)
    # LATENT bf16 DeepSeek-V3: one 576-wide row per token, no value cache.
    assert bytes_per_block(64, 1, 576, "bfloat16", 61, False) == 61 * 64 * 576 * 2
    assert bytes_per_block(16, 2, 64, "int8", 1, True) == 2 * 16 * 2 * 64
    assert bytes_per_block(16, 2, 65, "int4", 1, False) == 16 * 2 * 33  # packed, (head_size + 1) // 2
    assert bytes_per_block(16, 1, 64, "float16", 1, True, value_head_size=32) == 16 * (64 + 32) * 2
    with pytest.raises(ValueError, match="unknown cache dtype 'float5'"):
        bytes_per_block(16, 1, 64, "float5", 1, True)
    with pytest.raises(ValueError, match="num_layers must be >= 1, got 0"):
        bytes_per_block(16, 1, 64, "float16", 0, True)


def test_blocks_for_budget():
    assert blocks_for_budget(10_000, 1_000) == 10
    assert blocks_for_budget(999, 1_000) == 0
    with pytest.raises(ValueError, match="bytes_per_block must be >= 1, got 0"):
        blocks_for_budget(10, 0)
    with pytest.raises(ValueError, match="bytes_budget must be >= 0"):
        blocks_for_budget(-1, 10)


def _hide_cuda(monkeypatch):
    for name in ("cuda", "cuda.bindings", "cuda.bindings.runtime", "cuda.cudart"):
        monkeypatch.setitem(sys.modules, name, None)


def test_blocks_from_device_memory_without_cuda_python(monkeypatch):
    _hide_cuda(monkeypatch)
    with pytest.raises(ImportError, match=r"needs cuda-python \(pip install 'ortpa\[cuda\]'\)"):
        blocks_from_device_memory(1024)


def test_blocks_from_device_memory_reads_free_memory_of_the_device(monkeypatch):
    calls = []
    rt = types.SimpleNamespace(
        cudaGetDevice=lambda: (0, 3),
        cudaSetDevice=lambda d: calls.append(d) or (0,),
        cudaMemGetInfo=lambda: (0, 10_000, 80_000),
    )
    _hide_cuda(monkeypatch)
    pkg = types.ModuleType("cuda")
    pkg.bindings = types.ModuleType("cuda.bindings")
    pkg.bindings.runtime = rt
    monkeypatch.setitem(sys.modules, "cuda", pkg)
    monkeypatch.setitem(sys.modules, "cuda.bindings", pkg.bindings)
    monkeypatch.setitem(sys.modules, "cuda.bindings.runtime", rt)
    assert blocks_from_device_memory(100, memory_fraction=0.5, device_id=1) == 50
    assert calls == [1, 3]  # switched to the device, then back
    rt.cudaMemGetInfo = lambda: (2, 0, 0)
    with pytest.raises(RuntimeError, match="cudaMemGetInfo failed"):
        blocks_from_device_memory(100)
    assert calls[-1] == 3
    with pytest.raises(ValueError, match=r"memory_fraction must be in \(0, 1\], got 1.5"):
        blocks_from_device_memory(100, memory_fraction=1.5)


def test_copy_blocks_numpy_in_order_on_every_cache():
    k = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 1, 3)
    v = -k.copy()
    k0, v0 = k.copy(), v.copy()
    copy_blocks([k, v], [(0, 1), (1, 2)])  # a chain: block 2 must end up with block 0's rows
    for cache, orig in ((k, k0), (v, v0)):
        np.testing.assert_array_equal(cache[1], orig[0])
        np.testing.assert_array_equal(cache[2], orig[0])
        np.testing.assert_array_equal(cache[3], orig[3])
    with pytest.raises(IndexError, match=r"pair \(0, 4\) out of range for cache 0 of 4 blocks"):
        copy_blocks([k], [(0, 4)])
    with pytest.raises(TypeError, match="cache 0 is list"):
        copy_blocks([[1, 2]], [(0, 1)])


def test_copy_blocks_uses_the_given_copier():
    seen = []
    copy_blocks(["k0", "v0"], [(1, 2), (3, 4)], copier=lambda c, s, d: seen.append((c, s, d)))
    assert seen == [("k0", 1, 2), ("v0", 1, 2), ("k0", 3, 4), ("v0", 3, 4)]


# --------------------------------------------------------------------------------------------------
# Random interleavings against a model of what each slot holds


class KVCacheMachine(RuleBasedStateMachine):
    """Model: each live sequence is its list of token tags; ``store`` maps a slot to the tag written there.

    Every write goes where the cache says (``append``'s slots or ``slot_mapping``) after the pending copies
    are run on ``store``, as the runtime would. Reading each sequence back through its block list must then
    give its tags: this checks slots, block tables and copy-on-write together.
    """

    @initialize(block_size=st.sampled_from([1, 2, 3, 4]), num_blocks=st.integers(1, 10))
    def setup(self, block_size, num_blocks):
        self.bs = block_size
        self.cache = PagedKVCache(num_blocks, block_size)
        self.tokens: dict[int, list[int]] = {}
        self.store: dict[int, int] = {}
        self.next_id = 0
        self.next_tag = 0

    # helpers --------------------------------------------------------------------------------------
    def _new_tags(self, n):
        tags = list(range(self.next_tag, self.next_tag + n))
        self.next_tag += n
        return tags

    def _snapshot(self):
        c = self.cache
        return (
            {s: (c.num_tokens(s), c.block_ids(s)) for s in c.seq_ids},
            [c.pool.ref_count(b) for b in range(c.num_blocks)],
            c.num_free_blocks,
            list(c._pending_copies),
        )

    def _run_copies(self):
        for src, dst in self.cache.take_pending_copies():
            for off in range(self.bs):
                s, d = src * self.bs + off, dst * self.bs + off
                if s in self.store:
                    self.store[d] = self.store[s]
                else:
                    self.store.pop(d, None)

    def _write(self, slots, tags):
        slots = [int(x) for x in slots]
        assert len(set(slots)) == len(slots), f"two tokens write one slot: {slots}"
        for slot in slots:
            # An exclusive block: no other live sequence (a fork's parent or child) can see this write.
            assert self.cache.pool.ref_count(slot // self.bs) == 1, f"write into shared block {slot // self.bs}"
        self.store.update(zip(slots, tags, strict=True))

    def _pick(self, data):
        return data.draw(st.sampled_from(sorted(self.tokens)))

    # rules ------------------------------------------------------------------------------------------
    @rule(n=st.integers(0, 6))
    def add(self, n):
        sid, before = self.next_id, self._snapshot()
        self.next_id += 1
        try:
            self.cache.add_sequence(sid, num_tokens=n)
        except OutOfBlocks:
            assert self._snapshot() == before
            return
        tags = self._new_tags(n)
        self._write(self.cache.slots(sid, 0, n), tags)  # the caller writes what it committed
        self.tokens[sid] = tags

    @rule(data=st.data())
    def adopt_prefix(self, data):
        if not self.tokens:
            return
        donor = self._pick(data)
        have = len(self.tokens[donor])
        used = data.draw(st.integers(0, have))  # tokens taken from the donor's blocks
        shared = self.cache.block_ids(donor)[: -(-used // self.bs)]
        # Fresh tokens past the prefix only when the adopted blocks are full: a partial one holds the donor's.
        extra = data.draw(st.integers(0, 3)) if used % self.bs == 0 else 0
        sid, before = self.next_id, self._snapshot()
        self.next_id += 1
        try:
            self.cache.add_sequence(sid, num_tokens=used + extra, shared_blocks=shared)
        except OutOfBlocks:
            assert self._snapshot() == before
            return
        tags = self._new_tags(extra)
        self._write(self.cache.slots(sid, used, used + extra), tags)
        self.tokens[sid] = self.tokens[donor][:used] + tags

    @rule(data=st.data())
    def fork(self, data):
        if not self.tokens:
            return
        parent, child = self._pick(data), self.next_id
        self.next_id += 1
        free = self.cache.num_free_blocks
        self.cache.fork(parent, child)
        assert self.cache.num_free_blocks == free
        self.tokens[child] = list(self.tokens[parent])

    @rule(data=st.data(), n=st.integers(0, 5))
    def append(self, data, n):
        if not self.tokens:
            return
        sid, before = self._pick(data), self._snapshot()
        can = self.cache.can_append(sid, n)
        try:
            slots = self.cache.append(sid, n)
        except OutOfBlocks:
            assert not can and self._snapshot() == before
            return
        assert can
        self._run_copies()
        tags = self._new_tags(n)
        self._write(slots, tags)
        self.tokens[sid] += tags

    @rule(data=st.data(), width_slack=st.one_of(st.none(), st.integers(0, 2)))
    def plan_step(self, data, width_slack):
        if not self.tokens:
            return
        ids = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, unique=True))
        news = [data.draw(st.integers(0, 4)) for _ in ids]
        past = [len(self.tokens[s]) for s in ids]
        need_width = max(1, *(-(-(p + n) // self.bs) for p, n in zip(past, news, strict=True)))
        width = None if width_slack is None else need_width + width_slack
        before = self._snapshot()
        try:
            step = self.cache.plan_step(list(zip(ids, news, strict=True)), block_table_width=width)
        except OutOfBlocks:
            assert self._snapshot() == before
            return
        B, T = len(ids), sum(news)
        assert step.seq_ids == tuple(ids)
        assert step.cumulative_sequence_length.tolist() == [0, *np.cumsum(news).tolist()]
        assert step.past_seqlens.tolist() == past
        assert step.block_table.shape == (B, width or need_width)
        for i, s in enumerate(ids):
            row = step.block_table[i].tolist()
            blocks = self.cache.block_ids(s)
            assert len(blocks) == -(-(past[i] + news[i]) // self.bs)
            assert row == blocks + [-1] * (len(row) - len(blocks))
        expect_slots = [
            step.block_table[i, p // self.bs] * self.bs + p % self.bs
            for i in range(B)
            for p in range(past[i], past[i] + news[i])
        ]
        assert step.slot_mapping.tolist() == expect_slots and step.slot_mapping.shape == (T,)
        assert step.positions.tolist() == [p for i in range(B) for p in range(past[i], past[i] + news[i])]
        ends = np.cumsum(news) - 1
        assert step.last_token_indices.tolist() == [int(e) if n else -1 for e, n in zip(ends, news, strict=True)]
        kv = max(p + n for p, n in zip(past, news, strict=True))
        assert step.attention_metadata.tolist() == [max(news), kv, kv]
        self._run_copies()  # before the step, as the runtime must
        tags = self._new_tags(T)
        self._write(step.slot_mapping, tags)
        for s, n in zip(ids, news, strict=True):
            self.tokens[s] += tags[:n]
            tags = tags[n:]

    @rule(data=st.data())
    def free(self, data):
        if not self.tokens:
            return
        sid = self._pick(data)
        self.cache.free(sid)
        del self.tokens[sid]

    # invariants -------------------------------------------------------------------------------------
    @invariant()
    def refcounts_exact_and_no_leak(self):
        c = self.cache
        c.check_invariants()
        holders = collections.Counter(b for s in self.tokens for b in c.block_ids(s))
        assert [c.pool.ref_count(b) for b in range(c.num_blocks)] == [holders[b] for b in range(c.num_blocks)]
        assert c.num_free_blocks == c.num_blocks - len(holders)
        assert sorted(c.seq_ids) == sorted(self.tokens)

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        for sid, tags in self.tokens.items():
            assert self.cache.num_tokens(sid) == len(tags)
            got = [self.store.get(int(slot)) for slot in self.cache.slots(sid, 0, len(tags))]
            assert got == tags, f"sequence {sid}: read {got}, wrote {tags}"

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for sid in list(self.tokens):
            self.cache.free(sid)
        assert self.cache.num_free_blocks == self.cache.num_blocks, "blocks leaked"
        self.cache.check_invariants()


TestKVCacheMachine = KVCacheMachine.TestCase


# --------------------------------------------------------------------------------------------------
# Random interleavings with the prefix cache and preemption, as the scheduler drives them


class KVPrefixPreemptMachine(RuleBasedStateMachine):
    """:class:`PagedKVCache` + :class:`PrefixCache` under add / append / fork / preempt / resume / finish /
    evict / clear, in the order the scheduler uses them (adopt cached blocks first, evict only on shortage).

    The model is the test's own, never read back from the code: token ids per sequence (from a 2-letter
    alphabet, so prefixes collide and the cache hits often), the block list each live sequence must hold, the
    cache entries (hash -> block and the tokens up to that block's end), and per slot the *prefix* whose last
    token's K/V was written there (a token's K/V depends on every token before it). From these the test
    computes each block's exact ref count, the free count, and what every sequence and entry must read back.
    """

    @initialize(block_size=st.sampled_from([1, 2, 3]), num_blocks=st.integers(1, 12))
    def setup(self, block_size, num_blocks):
        self.bs = block_size
        self.cache = PagedKVCache(num_blocks, block_size)
        self.pc = PrefixCache(self.cache)
        self.live: dict[int, list[int]] = {}  # sequence -> token ids
        self.blocks: dict[int, list[int]] = {}  # sequence -> the blocks it must hold
        self.offered: dict[int, int] = {}  # sequence -> leading full blocks already offered to the cache
        self.preempted: dict[int, list[int]] = {}  # freed sequences waiting to be recomputed
        self.entries: dict[bytes, tuple[int, tuple[int, ...]]] = {}  # hash -> (block, tokens to its end)
        self.store: dict[int, tuple[int, ...]] = {}  # slot -> prefix whose last token was written there
        self.next_id = 0
        self.counts = collections.Counter()

    # model helpers ----------------------------------------------------------------------------------
    def _refs(self) -> collections.Counter:
        refs = collections.Counter(b for bl in self.blocks.values() for b in bl)
        refs.update(b for b, _ in self.entries.values())
        return refs

    def _hashes(self, tokens, n_blocks):
        hashes: list = []
        extend_block_hashes(hashes, tokens, self.bs, n_blocks)
        return hashes

    def _write(self, sid, start, slots):
        tokens = self.live[sid]
        for p, slot in zip(range(start, len(tokens)), slots, strict=True):
            assert self._refs()[int(slot) // self.bs] == 1, f"write into shared block {int(slot) // self.bs}"
            self.store[int(slot)] = tuple(tokens[: p + 1])

    def _make_room(self, need):
        """The scheduler's reservation: evict cached blocks only when the free pool is short."""
        short = need - self.cache.num_free_blocks
        if short > 0 and self.pc.num_evictable() >= short:
            self._evict(short)

    def _evict(self, n):
        refs = self._refs()
        evictable = {h for h, (b, _) in self.entries.items() if refs[b] == 1}
        assert self.pc.num_evictable() == len(evictable)
        got = self.pc.evict(n)
        gone = {h for h in self.entries if h not in self.pc}
        assert got == min(n, len(evictable)) == len(gone), (got, n, len(evictable), len(gone))
        assert gone <= evictable, "evicted a block a sequence still reads"
        for h in gone:
            del self.entries[h]
        self.counts["evicted"] += got

    def _offer(self, sid):
        """Offer the sequence's new full blocks to the cache, as Scheduler.commit does."""
        tokens, full = self.live[sid], len(self.live[sid]) // self.bs
        hashes = self._hashes(tokens, full)
        for b in range(self.offered[sid], full):
            fresh = hashes[b] not in self.entries
            assert self.pc.insert(hashes[b], self.blocks[sid][b], tokens[b * self.bs : (b + 1) * self.bs]) == fresh
            if fresh:
                self.entries[hashes[b]] = (self.blocks[sid][b], tuple(tokens[: (b + 1) * self.bs]))
        self.offered[sid] = full

    def _admit(self, sid, tokens) -> bool:
        """Adopt the cached prefix, then reserve and compute the rest; False (nothing changed) if it can't fit."""
        limit = (len(tokens) - 1) // self.bs  # never the last token: the scheduler needs its logits
        hashes = self._hashes(tokens, limit)
        want = []
        for h in hashes:
            if h not in self.entries:
                break
            want.append(self.entries[h][0])
        hits = self.pc.match(hashes, tokens)
        assert hits == want, f"prefix match {hits}, model expects {want}"
        cached = len(hits) * self.bs
        self.cache.add_sequence(sid, cached, shared_blocks=hits)  # full blocks only: allocates nothing
        self.live[sid], self.blocks[sid], self.offered[sid] = list(tokens), list(hits), len(hits)
        self.pc.touch(hashes[: len(hits)])
        self._make_room(self.cache.blocks_needed(sid, len(tokens) - cached))
        try:
            slots = self.cache.append(sid, len(tokens) - cached)
        except OutOfBlocks:
            self.cache.free(sid)
            for d in (self.live, self.blocks, self.offered):
                del d[sid]
            self.counts["admit_refused"] += 1
            return False
        got = self.cache.block_ids(sid)
        assert got[: len(hits)] == hits and len(got) == -(-len(tokens) // self.bs)
        self.blocks[sid] = got
        assert not self.cache.take_pending_copies(), "adopting full blocks must not copy"
        self._write(sid, cached, slots)
        self._offer(sid)
        self.counts["adopted_blocks"] += len(hits)
        return True

    def _pick(self, data, pool):
        return data.draw(st.sampled_from(sorted(pool)))

    # rules ------------------------------------------------------------------------------------------
    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def add(self, tokens):
        sid = self.next_id
        self.next_id += 1
        if not self._admit(sid, tokens):
            self.preempted[sid] = tokens  # it waits, as a request the scheduler could not admit

    @rule(data=st.data(), new=st.lists(st.integers(0, 1), min_size=0, max_size=4))
    def append(self, data, new):
        if self.live:
            self._append(self._pick(data, self.live), new)

    def _append(self, sid, new):
        old = list(self.blocks[sid])
        length = len(self.live[sid])
        cow = bool(new) and length % self.bs != 0 and self._refs()[old[-1]] > 1
        self._make_room(self.cache.blocks_needed(sid, len(new)))
        try:
            slots = self.cache.append(sid, len(new))
        except OutOfBlocks:
            assert self.cache.block_ids(sid) == old
            return
        got = self.cache.block_ids(sid)
        copies = self.cache.take_pending_copies()
        if cow:
            assert got[: len(old) - 1] == old[:-1] and got[len(old) - 1] != old[-1]
            assert copies == [(old[-1], got[len(old) - 1])]
            for off in range(self.bs):  # the runtime runs the copy before the step writes
                src = old[-1] * self.bs + off
                if src in self.store:
                    self.store[got[len(old) - 1] * self.bs + off] = self.store[src]
            self.counts["cow"] += 1
        else:
            assert got[: len(old)] == old and not copies
        assert len(got) == -(-(length + len(new)) // self.bs)
        self.blocks[sid] = got
        self.live[sid] += new
        self._write(sid, length, slots)
        self._offer(sid)

    @rule(data=st.data(), diverge=st.lists(st.integers(0, 1), max_size=3))
    def fork(self, data, diverge):
        """Share every block; ``diverge`` is appended to the child at once (a beam), copying a shared tail."""
        if not self.live:
            return
        parent, child = self._pick(data, self.live), self.next_id
        self.next_id += 1
        free = self.cache.num_free_blocks
        self.cache.fork(parent, child)
        assert self.cache.num_free_blocks == free
        self.live[child] = list(self.live[parent])
        self.blocks[child] = list(self.blocks[parent])
        self.offered[child] = self.offered[parent]
        self._append(child, diverge)

    @rule(data=st.data())
    def preempt(self, data):
        """Free a running sequence's blocks; it is recomputed later (Scheduler._preempt)."""
        if not self.live:
            return
        sid = self._pick(data, self.live)
        self.cache.free(sid)
        self.pc.release(self._hashes(self.live[sid], self.offered[sid]))
        self.preempted[sid] = self.live.pop(sid)
        del self.blocks[sid], self.offered[sid]
        self.counts["preempted"] += 1

    @rule(data=st.data())
    def resume(self, data):
        if not self.preempted:
            return
        sid = self._pick(data, self.preempted)
        if self._admit(sid, self.preempted[sid]):
            del self.preempted[sid]
            self.counts["resumed"] += 1

    @rule(data=st.data())
    def finish(self, data):
        if not self.live:
            return
        sid = self._pick(data, self.live)
        self.cache.free(sid)
        for d in (self.live, self.blocks, self.offered):
            del d[sid]

    @rule(n=st.integers(0, 4))
    def evict(self, n):
        self._evict(n)

    @rule()
    def clear(self):
        self.pc.clear()
        self.entries.clear()

    # invariants -------------------------------------------------------------------------------------
    @invariant()
    def refcounts_exact_no_leak_no_double_free(self):
        c, refs = self.cache, self._refs()
        c.check_invariants()
        assert [c.pool.ref_count(b) for b in range(c.num_blocks)] == [refs[b] for b in range(c.num_blocks)]
        used = sum(1 for b in range(c.num_blocks) if refs[b])
        assert c.num_free_blocks + used == c.num_blocks
        for sid, blocks in self.blocks.items():
            assert c.block_ids(sid) == blocks and c.num_tokens(sid) == len(self.live[sid])
        holders = sorted(b for b, _ in self.entries.values())
        assert sorted(s for s in c.seq_ids if isinstance(s, int)) == sorted(self.live)
        assert sorted(s.block for s in c.seq_ids if isinstance(s, CacheHolder)) == holders
        assert len(self.pc) == len(self.entries)

    @invariant()
    def sequences_and_cache_entries_read_back_their_prefixes(self):
        for sid, tokens in self.live.items():
            for p, slot in enumerate(self.cache.slots(sid, 0, len(tokens))):
                assert self.store.get(int(slot)) == tuple(tokens[: p + 1]), f"sequence {sid}, token {p}"
        for block, prefix in self.entries.values():
            start = len(prefix) - self.bs
            for off in range(self.bs):
                got = self.store.get(block * self.bs + off)
                assert got == prefix[: start + off + 1], f"cached block {block} was overwritten"

    def teardown(self):
        if not hasattr(self, "cache"):
            return
        for sid in list(self.live):
            self.cache.free(sid)
        self.pc.clear()
        assert self.cache.num_free_blocks == self.cache.num_blocks, "blocks leaked"
        assert all(self.cache.pool.ref_count(b) == 0 for b in range(self.cache.num_blocks))
        self.cache.check_invariants()
        KV_PREFIX_COUNTS.update(self.counts)


KV_PREFIX_COUNTS: collections.Counter = collections.Counter()  # what the examples exercised, for the report
TestKVPrefixPreemptMachine = KVPrefixPreemptMachine.TestCase
# The ci profile's 60 derandomized examples rarely reach copy-on-write or a resume; 200 do (~45 each, ~6 s).
TestKVPrefixPreemptMachine.settings = settings(settings.default, max_examples=max(settings.default.max_examples, 200))
