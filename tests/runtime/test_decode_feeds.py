"""All-decode steps on bound index arrays (ortpa.runtime.decode_feeds): the same tokens as the unbound path.

The Engine keeps the index inputs of an all-decode step in preallocated arrays bound to the session once and
updated in place. The reference is the same engine with that path off (``_decode_feeds = None``: every step
builds its feeds and binds them, as before), which must give identical tokens: the feeds hold the same values.
Block size 4 on the toy model makes decodes cross block boundaries every four tokens.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from ortpa.errors import InvalidParameter, OutOfBlocks
from ortpa.runtime.decode_feeds import DecodeFeeds
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.runtime.kv import InvalidSequenceOp, PagedKVCache
from ortpa.runtime.sampling import Sampler, needs_processing, sample_rows
from ortpa.runtime.session import PagedSession
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

CPU = ["CPUExecutionProvider"]
BS = 4
CFG = ToyLMConfig()
MODEL = build_toy_lm(CFG)
LENGTHS = [(3, 9), (17, 5), (40, 12), (1, 7), (9, 10), (26, 4)]  # (prompt, new tokens): mixed, some cross blocks
RNG = np.random.default_rng(0)
PROMPTS = [[int(t) for t in RNG.integers(0, CFG.vocab, size=n)] for n, _ in LENGTHS]
PARAMS = [SamplingParams(max_new_tokens=m) for _, m in LENGTHS]


def _engine(bound: bool, model=MODEL, block_size: int = BS, **kw) -> Engine:
    kw.setdefault("num_blocks", 64)
    engine = Engine(model, block_size=block_size, providers=CPU, **kw)
    if not bound:
        engine._decode_feeds = None  # the unbound path: feeds built and bound every step
    return engine


def _staggered(engine: Engine, arrivals: dict[int, list[int]], params=PARAMS) -> tuple[list[list[int]], int]:
    """Add request i at step s for i in arrivals[s]; step to the end. (outputs in request order, bound steps)."""
    ids: dict[int, str] = {}
    outputs: dict[str, list[int]] = {}
    bound_steps, step = 0, 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            ids[i] = engine.add_request(PROMPTS[i], params[i])
            outputs[ids[i]] = []
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        bound_steps += engine._decode_feeds is not None and engine._decode_feeds.seq_ids != ()
        step += 1
    return [outputs[ids[i]] for i in range(len(ids))], bound_steps


@pytest.fixture(scope="module")
def unbound() -> list[list[int]]:
    return _staggered(_engine(False, enable_prefix_caching=False), {0: [0, 1], 2: [2], 3: [3, 4], 9: [5]})[0]


# -- the engine: bound steps against the unbound path -----------------------------------------------------
def test_bound_decode_steps_give_the_unbound_tokens_as_requests_join_and_leave(unbound):
    engine = _engine(True, enable_prefix_caching=False)
    got, bound_steps = _staggered(engine, {0: [0, 1], 2: [2], 3: [3, 4], 9: [5]})
    assert got == unbound
    assert bound_steps >= 10  # most steps decode only, on the bound arrays
    assert engine.kv.num_free_blocks == engine.num_blocks
    engine.kv.check_invariants()


def test_a_batch_of_different_lengths_crosses_block_boundaries_mid_run():
    # prompts of 3, 6 and 8 tokens: the first sequence crosses into its second block after one decode, the
    # second after two, the third widens the table after four; the layout changes only then
    prompts = [PROMPTS[2][:3], PROMPTS[2][:6], PROMPTS[2][:8]]
    params = SamplingParams(max_new_tokens=10)
    want = _engine(False).generate(prompts, params)
    engine = _engine(True)
    layouts = []
    spy = engine.session.bind_step

    def counting(feeds, names, **kw):
        layouts.append(engine._decode_feeds.layout)
        return spy(feeds, names, **kw)

    engine.session.bind_step = counting
    assert engine.generate(prompts, params) == want
    # 9 decode steps over contexts 8..16 of the longest: its table widens at 9 and 13 (blocks of 4), and the
    # first decode step binds: three bindings for nine bound steps
    assert len(layouts) == 3 and layouts == sorted(set(layouts))


def test_prefix_caching_and_preemption_keep_the_unbound_tokens():
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(0, CFG.vocab, size=2 * BS)]
    prompts = [shared + [int(t) for t in rng.integers(0, CFG.vocab, size=3 + i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=7)

    def run(bound: bool, **kw) -> list[list[int]]:
        engine = _engine(bound, **kw)
        out = engine.generate(prompts[:1], params) + engine.generate(prompts[1:], params)
        engine.kv.check_invariants()
        return out

    assert run(True) == run(False)
    # 9 blocks of 4: the batch does not fit, the newest requests are preempted and recomputed
    small = _engine(True, num_blocks=9)
    assert small.generate(prompts, params) == run(False, num_blocks=9)
    assert small.stats.preemptions > 0


def test_native_block_size_and_logits_modes_keep_the_unbound_tokens():
    # block size 16 runs the native kernel where the library is built; "all" logits and position_ids inputs
    cfg = ToyLMConfig(logits="all", position_ids=True, attention_metadata=False, seed=1)
    model = build_toy_lm(cfg)
    prompts = [PROMPTS[2][:14], PROMPTS[1], PROMPTS[0]]
    params = SamplingParams(max_new_tokens=9)
    for m, bs in ((model, 16), (MODEL, 16)):
        assert _engine(True, m, bs).generate(prompts, params) == _engine(False, m, bs).generate(prompts, params)


def test_sampling_params_that_need_processing_fall_back_to_the_full_path():
    hot = [
        SamplingParams(max_new_tokens=8, temperature=1.3, top_p=0.9, seed=11),
        SamplingParams(max_new_tokens=8, logprobs=3),
        SamplingParams(max_new_tokens=8, repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(max_new_tokens=8, logit_bias={3: 5.0}),
        SamplingParams(max_new_tokens=8, stop_token_ids=[1], min_tokens=5),
        SamplingParams(max_new_tokens=8),
    ]
    assert [needs_processing(p) for p in hot] == [True] * 5 + [False]
    # stop tokens alone do not need the processors: they are checked after the choice
    assert not needs_processing(SamplingParams(stop_token_ids=[1]))

    def run(bound: bool):
        engine = _engine(bound)
        ids = [engine.add_request(p, s) for p, s in zip(PROMPTS, hot, strict=True)]
        got: dict[str, list] = {i: [] for i in ids}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id].append((out.new_token_ids, out.logprobs, out.finish_reason))
        return [got[i] for i in ids]

    assert run(True) == run(False)


def test_greedy_fast_path_picks_the_lowest_id_on_ties_and_none_on_an_empty_row():
    rows = np.array([[0.0, 2.0, 2.0, 1.0], [-np.inf] * 4, [5.0, 1.0, 5.0, 0.0]], np.float32)
    plain = [Sampler(SamplingParams()) for _ in range(3)]
    fast = sample_rows(rows, plain, [None] * 3)  # the fast path reads no row context
    assert [s.token_id for s in fast] == [1, None, 0]
    # the same rows through the processors (one request asks for logprobs): the same choices
    slow = sample_rows(rows, [*plain[:2], Sampler(SamplingParams(logprobs=1))], _contexts(3))
    assert [s.token_id for s in slow] == [1, None, 0]


def _contexts(n: int):
    from ortpa.runtime.sampling import RowContext

    return [RowContext(SamplingParams(), [0], 1) for _ in range(n)]


# -- the block manager's cheap path and the arrays --------------------------------------------------------
def _twins(lengths: list[int], num_blocks: int = 32) -> tuple[PagedKVCache, PagedKVCache]:
    kvs = (PagedKVCache(num_blocks, BS), PagedKVCache(num_blocks, BS))
    for kv in kvs:
        for i, n in enumerate(lengths):
            kv.add_sequence(i, n)
    return kvs


def test_feeds_hold_what_plan_step_emits_step_after_step():
    lengths = [3, 8, 1, 13]
    a, b = _twins(lengths)
    feeds = DecodeFeeds(attention_metadata=True, position_ids=True)
    arrays = None
    for step in range(9):
        ids = list(range(len(lengths))) if step < 6 else [0, 2, 3]  # a request leaves after six steps
        feeds.plan(a, ids)
        ref = b.plan_step([(s, 1) for s in ids])
        f = feeds.feeds
        np.testing.assert_array_equal(f["cumulative_sequence_lengths"], ref.cumulative_sequence_length)
        np.testing.assert_array_equal(f["past_sequence_lengths"], ref.past_seqlens)
        np.testing.assert_array_equal(f["block_table"], ref.block_table)
        np.testing.assert_array_equal(f["attention_metadata"], ref.attention_metadata)
        np.testing.assert_array_equal(f["position_ids"], ref.positions)
        assert [a.block_ids(s) for s in ids] == [b.block_ids(s) for s in ids]
        if step in (1, 2):  # same batch, no widening: the very same arrays, updated in place
            assert all(f[k] is arrays[k] for k in f)
        arrays = dict(f)
    a.check_invariants()


def test_plan_decodes_copies_a_shared_partial_block_on_write():
    a, b = _twins([6])
    for kv in (a, b):
        kv.fork(0, 1)  # both sequences share a partial last block
    feeds = DecodeFeeds(attention_metadata=True, position_ids=False)
    feeds.plan(a, [0, 1])
    ref = b.plan_step([(0, 1), (1, 1)])
    np.testing.assert_array_equal(feeds.feeds["block_table"], ref.block_table)
    assert a.take_pending_copies() == b.take_pending_copies() != []
    assert a.plan_decodes([0, 1]) == []  # both inside their own last blocks now: no cell changes
    a.check_invariants()


def test_plan_decodes_is_all_or_nothing_and_checks_its_batch():
    kv = PagedKVCache(3, BS)
    kv.add_sequence("a", 4)  # full: its next token needs a new block
    kv.add_sequence("b", 8)
    assert kv.num_free_blocks == 0
    with pytest.raises(OutOfBlocks):
        kv.plan_decodes(["a", "b"])
    assert kv.num_tokens("a") == 4 and kv.num_tokens("b") == 8
    with pytest.raises(InvalidSequenceOp, match="twice"):
        kv.plan_decodes(["b", "b"])
    kv.check_invariants()


def test_a_step_not_planned_by_the_feeds_resets_them():
    engine = _engine(True)
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=6))
    engine.step()  # the prompt
    engine.step()  # a decode: bound
    assert engine._decode_feeds.seq_ids == ("0",)
    engine.add_request(PROMPTS[1], SamplingParams(max_new_tokens=2))
    engine.step()  # a prompt chunk with the decode: planned by plan_step
    assert engine._decode_feeds.seq_ids == ()


# -- the session ------------------------------------------------------------------------------------------
def _decoding_session(model=MODEL) -> tuple[PagedSession, DecodeFeeds]:
    """A session whose sequence 0 holds a 5-token prompt, and the feeds of its next decode."""
    sess = PagedSession(model, num_blocks=8, block_size=BS, providers=CPU)
    kv = PagedKVCache(8, BS)
    kv.add_sequence(0)
    prompt = kv.plan_step([(0, 5)])
    sess.run(prompt.model_feeds(np.array(PROMPTS[2][:5], np.int64), attention_metadata=True, position_ids=False))
    feeds = DecodeFeeds(attention_metadata=True, position_ids=False)
    feeds.plan(kv, [0])
    return sess, feeds


def test_bind_step_binds_by_reference_and_run_bound_reads_the_arrays_as_they_are():
    sess, feeds = _decoding_session()
    with pytest.raises(InvalidParameter, match="bind_step first"):
        sess.run_bound()
    feeds.set_tokens([7])
    sess.bind_step(feeds.feeds, ["logits"])
    first = sess.run_bound()["logits"].copy()
    feeds.set_tokens([9])  # in place: the bound step now reads token 9
    second = sess.run_bound()["logits"]
    unbound = sess.run(dict(feeds.feeds), ["logits"])["logits"]
    np.testing.assert_array_equal(second, unbound)
    assert not np.array_equal(first, second)
    with pytest.raises(InvalidParameter, match="bound by reference"):
        sess.bind_step({**feeds.feeds, "block_table": np.zeros((1, 4), np.int32)[:, ::2]}, ["logits"])


def test_bind_step_writes_an_output_into_the_callers_array_each_run():
    sess, feeds = _decoding_session()
    declared = next(o for o in MODEL.graph.output if o.name == "logits").type.tensor_type
    buf = sess.step_output("logits", 1)
    assert buf.shape == (1, CFG.vocab)
    assert buf.dtype == onnx.helper.tensor_dtype_to_np_dtype(declared.elem_type)
    feeds.set_tokens([7])
    sess.bind_step(feeds.feeds, ["logits"], into={"logits": buf})
    out = sess.run_bound()["logits"]
    assert out is buf  # written in place: no array of ONNX Runtime's own
    first = buf.copy()
    feeds.set_tokens([9])
    assert sess.run_bound()["logits"] is buf
    np.testing.assert_array_equal(buf, sess.run(dict(feeds.feeds), ["logits"])["logits"])
    assert not np.array_equal(first, buf)  # the next run overwrote the rows


def test_bind_step_refuses_outputs_it_cannot_write_in_place():
    sess, feeds = _decoding_session()
    buf = sess.step_output("logits", 1)
    with pytest.raises(InvalidParameter, match="one of the fetched outputs"):
        sess.bind_step(feeds.feeds, [], into={"logits": buf})
    with pytest.raises(InvalidParameter, match="bound by reference"):
        sess.bind_step(feeds.feeds, ["logits"], into={"logits": np.zeros((1, 2 * CFG.vocab), buf.dtype)[:, ::2]})
    assert sess.step_output("no_such_output", 1) is None


def test_step_output_needs_every_trailing_dimension():
    model = onnx.ModelProto()
    model.CopyFrom(MODEL)
    logits = next(o for o in model.graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[-1].dim_param = "vocab"  # the value becomes a symbol
    sess, _ = _decoding_session(model)
    assert sess.step_output("logits", 1) is None


def test_the_engines_decodes_write_logits_into_one_array_per_batch():
    engine = _engine(True)
    engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=6))
    engine.step()  # the prompt
    engine.step()  # a decode: bound, logits written in place
    written = engine.session._step_binding[3]
    assert list(written) == ["logits"] and written["logits"][0].shape == (1, CFG.vocab)


def _resident_pages(array: np.ndarray) -> tuple[int, int]:
    """(resident, total) pages of ``array``'s buffer, by mincore(2)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = array.ctypes.data // page * page
    length = array.ctypes.data + array.nbytes - start
    pages = -(-length // page)
    vec = (ctypes.c_ubyte * pages)()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec)
    assert rc == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec), pages


def test_the_cpu_pool_is_resident_before_the_first_step():
    sess = PagedSession(MODEL, num_blocks=2048, block_size=BS, providers=CPU)  # MBs: pages mapped, not allocated
    for name, array in sess._arrays.items():
        resident, pages = _resident_pages(array)
        assert resident == pages, f"{name}: {resident} of {pages} pages resident"
        assert not array.any()
