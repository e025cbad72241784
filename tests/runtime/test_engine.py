"""ortpa.Engine on CPU: continuous batching, chunked prefill, prefix caching, preemption, sampling, stops.

Everything runs the toy paged LM (ortpa.testing.toy_lm) through the portable PagedAttention. The reference
for "correct" is the same request run alone (exact token equality), and the toy LM itself is checked against
a dense NumPy recomputation of its weights.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.tolerances import assert_close, max_tie_flips, tie_bound

from ortpa.runtime.engine import Engine, RequestTooLarge, SamplingParams, UnknownRequest
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.scheduler import InvalidRequest
from ortpa.runtime.session import PagedSession
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm, toy_lm_reference, toy_lm_weights

CPU = ["CPUExecutionProvider"]
BS = 4  # small blocks, so short prompts span several blocks and decodes cross block boundaries
CFG = ToyLMConfig()
WEIGHTS = toy_lm_weights(CFG)
MODEL = build_toy_lm(CFG, WEIGHTS)
# mixed prompt lengths (1 token to 10 blocks) and output lengths
LENGTHS = [(3, 9), (17, 5), (40, 12), (1, 7), (9, 10), (26, 4)]


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, CFG.vocab, size=n)] for n, _ in LENGTHS]


PROMPTS = _prompts()
PARAMS = [SamplingParams(max_new_tokens=m) for _, m in LENGTHS]


def _engine(model=MODEL, **kw) -> Engine:
    kw.setdefault("num_blocks", 64)
    return Engine(model, block_size=BS, providers=CPU, **kw)


@pytest.fixture(scope="module")
def alone() -> list[list[int]]:
    """Each request run by itself, one after another, without prefix caching: the reference outputs."""
    engine = _engine(enable_prefix_caching=False)
    return [engine.generate([p], s)[0] for p, s in zip(PROMPTS, PARAMS, strict=True)]


def _run_staggered(engine: Engine, arrivals: dict[int, list[int]], params=PARAMS) -> list[list[int]]:
    """Add request i at step ``s`` for i in ``arrivals[s]``; step until all finish; outputs in request order."""
    ids: dict[int, str] = {}
    outputs: dict[str, list[int]] = {}
    step = 0
    while step <= max(arrivals) or engine.has_unfinished():
        for i in arrivals.get(step, []):
            ids[i] = engine.add_request(PROMPTS[i], params[i])
            outputs[ids[i]] = []
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
        step += 1
    return [outputs[ids[i]] for i in range(len(ids))]


# -- the toy model itself ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg",
    [CFG, ToyLMConfig(logits="all", position_ids=True, attention_metadata=False, seed=1)],
    ids=["last-logits", "all-logits+position_ids"],
)
def test_toy_lm_paged_steps_match_dense_numpy(cfg):
    weights = toy_lm_weights(cfg)
    sess = PagedSession(build_toy_lm(cfg, weights), num_blocks=16, block_size=BS, providers=CPU)
    kv = PagedKVCache(16, BS)
    seqs = [[5, 9, 2, 33, 7, 1, 60], [11, 3, 8]]
    for s in range(2):
        kv.add_sequence(s)
    new = [list(s) for s in seqs]  # prefill both, then 3 decode steps (the first crosses a block boundary)
    for step in range(4):
        plan = kv.plan_step([(s, len(new[s])) for s in range(2)])
        feeds = {
            "input_ids": np.array(new[0] + new[1], np.int64),
            "cumulative_sequence_lengths": plan.cumulative_sequence_length,
            "past_sequence_lengths": plan.past_seqlens,
            "block_table": plan.block_table,
        }
        if cfg.attention_metadata:
            feeds["attention_metadata"] = plan.attention_metadata
        if cfg.position_ids:
            feeds["position_ids"] = plan.positions
        logits = sess.run(feeds)["logits"]
        if cfg.logits == "all":
            assert logits.shape == (plan.num_tokens, cfg.vocab)
            logits = logits[plan.last_token_indices]
        assert logits.shape == (2, cfg.vocab)
        for s in range(2):
            ref = toy_lm_reference(cfg, weights, seqs[s])[-1]
            assert_close(logits[s], ref, np.float16, what=f"step {step}, sequence {s}")
            nxt = int(np.argmax(ref))
            seqs[s].append(nxt)
            new[s] = [nxt]


def _assert_greedy_picks(cfg, weights, prompts, outputs) -> None:
    """Each token the engine picked is the argmax of the dense NumPy logits or a tie flip, and flips are rare
    (``ortpa.tolerances``: the float16 tie rule)."""
    ties, flips, checked = tie_bound(np.float16), 0, 0
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = list(prompt)
        for tok in out:
            ref = toy_lm_reference(cfg, weights, tokens)[-1]
            verdict = ties.classify(ref, tok)
            assert verdict != "mismatch", f"token {tok} after {len(tokens)} tokens is not a greedy pick"
            flips, checked = flips + (verdict == "tie"), checked + 1
            tokens.append(tok)
    assert flips <= max_tie_flips(checked), f"{flips} tie flips in {checked} tokens"


def test_engine_greedy_follows_the_dense_model(alone):
    _assert_greedy_picks(CFG, WEIGHTS, PROMPTS, alone)
    assert [len(o) for o in alone] == [m for _, m in LENGTHS]


# -- batching --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mixed_steps", [True, False], ids=["mixed-steps", "prompt-steps-first"])
def test_staggered_batch_equals_each_request_alone(alone, mixed_steps):
    engine = _engine(enable_prefix_caching=False, max_num_batched_tokens=24, mixed_steps=mixed_steps)
    kinds = []  # per step: did it hold prompt chunks, decodes, or both
    schedule = engine.scheduler.schedule

    def spy(*args):
        plan = schedule(*args)
        kinds.append({c.request.is_decoding for c in plan.chunks})  # before commit: as the scheduler saw them
        return plan

    engine.scheduler.schedule = spy
    got = _run_staggered(engine, {0: [0, 1], 2: [2], 3: [3, 4], 7: [5]})
    assert got == alone
    assert ({True, False} in kinds) == mixed_steps  # prompt chunks next to decodes only in mixed steps
    assert engine.stats.steps < sum(m for _, m in LENGTHS)  # requests really shared steps
    assert engine.kv.num_free_blocks == engine.num_blocks and len(engine.kv) == 0


def test_generate_returns_outputs_in_prompt_order(alone):
    engine = _engine()
    order = [4, 0, 5, 2, 1, 3]
    got = engine.generate([PROMPTS[i] for i in order], [PARAMS[i] for i in order])
    assert got == [alone[i] for i in order]


def test_other_logits_mode_and_position_ids_input_batch_equals_alone():
    cfg = ToyLMConfig(logits="all", position_ids=True, attention_metadata=False, seed=1)
    weights = toy_lm_weights(cfg)
    engine = _engine(build_toy_lm(cfg, weights))
    assert engine.io.position_ids and not engine.io.attention_metadata
    want = [engine.generate([p], s)[0] for p, s in zip(PROMPTS[:4], PARAMS[:4], strict=True)]
    assert engine.generate(PROMPTS[:4], PARAMS[:4]) == want
    _assert_greedy_picks(cfg, weights, PROMPTS[:4], want)


def test_chunked_prefill_under_a_tiny_token_budget(alone):
    engine = _engine(max_num_batched_tokens=5, enable_prefix_caching=False)
    assert engine.generate(PROMPTS, PARAMS) == alone
    stats = engine.stats
    assert stats.computed_tokens <= 5 * stats.steps
    # the 40-token prompt alone needs 8 steps of 5 tokens before its first sample
    assert stats.steps >= 40 // 5 + 12 - 1


def test_stream_yields_every_token_once_in_order(alone):
    engine = _engine()
    seen: dict[str, list[int]] = {}
    ids = [engine.add_request(p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)]
    for _ in range(3):
        engine.step()
    for rid, tok in engine.stream(ids):
        seen.setdefault(rid, []).append(tok)
    assert [seen[i] for i in ids] == alone
    streamed = {}
    for rid, tok in engine.stream(PROMPTS[:2], PARAMS[0]):
        streamed.setdefault(rid, []).append(tok)
    assert list(streamed.values()) == [engine.generate([p], PARAMS[0])[0] for p in PROMPTS[:2]]


# -- prefix caching --------------------------------------------------------------------------------------
def test_prefix_cache_computes_a_shared_prefix_once():
    rng = np.random.default_rng(5)
    shared = [int(t) for t in rng.integers(0, CFG.vocab, size=2 * BS)]  # two full blocks
    prompts = [shared + [int(t) for t in rng.integers(0, CFG.vocab, size=3 + i)] for i in range(5)]
    params = SamplingParams(max_new_tokens=6)

    def run(enable: bool) -> tuple[list[list[int]], Engine]:
        engine = _engine(enable_prefix_caching=enable)
        first = engine.generate(prompts[:1], params)  # fills the cache; the rest arrive later
        return first + engine.generate(prompts[1:], params), engine

    plain, off = run(False)
    cached, on = run(True)
    assert cached == plain
    saved = off.stats.computed_tokens - on.stats.computed_tokens
    assert on.stats.cached_tokens == 4 * 2 * BS  # every later request adopts both shared blocks
    assert saved == on.stats.cached_tokens
    # cached blocks outlive their requests, but remain available to the pool
    assert on.num_available_blocks == on.num_blocks and on.kv.num_free_blocks < on.num_blocks
    on.reset_prefix_cache()
    assert on.kv.num_free_blocks == on.num_blocks
    on.kv.check_invariants()


def test_whole_prompt_cached_still_computes_its_last_token():
    engine = _engine()
    prompt = PROMPTS[1][: 3 * BS]  # exactly three full blocks
    first = engine.generate([prompt], PARAMS[1])
    again = engine.generate([prompt], PARAMS[1])
    assert again == first
    assert engine.stats.cached_tokens == 2 * BS  # the last block is recomputed: it holds the token to sample


# -- preemption ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("prefix_caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_preemption_in_a_tiny_pool_completes_every_request(alone, prefix_caching):
    # 13 blocks of 4: the longest request (40 + 12 - 1 tokens) just fits alone, the batch does not
    engine = _engine(num_blocks=13, enable_prefix_caching=prefix_caching)
    got = _run_staggered(engine, {0: [0, 1, 2, 3, 4, 5]})
    assert got == alone
    assert engine.stats.preemptions > 0
    assert engine.num_available_blocks == engine.num_blocks
    engine.reset_prefix_cache()
    assert engine.kv.num_free_blocks == engine.num_blocks and len(engine.kv) == 0
    engine.kv.check_invariants()


def test_a_request_larger_than_the_pool_is_refused_at_add_time():
    engine = _engine(num_blocks=12)
    with pytest.raises(RequestTooLarge, match="need 13 KV blocks of 4, but the pool holds 12") as info:
        engine.add_request(PROMPTS[2], PARAMS[2])  # 40 + 12 - 1 = 51 tokens
    assert info.value.blocks == 13 and not engine.has_unfinished()
    with pytest.raises(RequestTooLarge):  # generate checks every prompt before queueing any
        engine.generate(PROMPTS, PARAMS)
    assert not engine.has_unfinished()
    with pytest.raises(InvalidRequest, match="empty"):
        engine.add_request([], PARAMS[0])
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        engine.add_request([1, CFG.vocab], PARAMS[0])
    engine.add_request([1, 2], PARAMS[0], request_id="mine")
    with pytest.raises(InvalidRequest, match="'mine' is already in use"):
        engine.add_request([3], PARAMS[0], request_id="mine")


# -- sampling, stops, abort ------------------------------------------------------------------------------
def test_seeded_sampling_is_reproducible_alone_or_batched():
    hot = [SamplingParams(max_new_tokens=10, temperature=1.5, top_p=0.95, seed=100 + i) for i in range(6)]
    engine = _engine()
    batched = engine.generate(PROMPTS, hot)
    alone = [engine.generate([p], s)[0] for p, s in zip(PROMPTS, hot, strict=True)]
    assert batched == alone
    reseeded = [SamplingParams(max_new_tokens=10, temperature=1.5, top_p=0.95, seed=7) for _ in range(6)]
    assert engine.generate(PROMPTS, reseeded) != batched  # other seeds, other tokens


def test_top_k_one_equals_greedy(alone):
    params = [SamplingParams(max_new_tokens=m, temperature=0.8, top_k=1, seed=3) for _, m in LENGTHS]
    assert _engine().generate(PROMPTS, params) == alone


def test_stop_token_ends_a_request(alone):
    out = alone[2]
    stop = out[4]
    first = out.index(stop)
    engine = _engine()
    rid = engine.add_request(PROMPTS[2], SamplingParams(max_new_tokens=12, stop_token_ids=[stop]))
    got, reasons = [], []
    while engine.has_unfinished():
        for o in engine.step():
            got.extend(o.new_token_ids)
            reasons.append(o.finish_reason)
            assert o.request_id == rid
    assert got == out[: first + 1]  # the stop token is emitted, nothing after it
    assert reasons[-1] == "stop" and set(reasons[:-1]) == {None}


def test_abort_frees_blocks_and_the_rest_still_finish(alone):
    engine = _engine(enable_prefix_caching=False)
    ids = [engine.add_request(p, s) for p, s in zip(PROMPTS, PARAMS, strict=True)]
    engine.step()
    engine.step()
    held = len(engine.kv.block_ids(ids[2]))
    free = engine.kv.num_free_blocks
    engine.abort(ids[2])
    assert engine.kv.num_free_blocks == free + held and ids[2] not in engine.kv
    engine.abort(ids[5])
    outputs: dict[str, list[int]] = {i: list(engine.scheduler.requests[i].output) for i in engine.scheduler.requests}
    for out in (o for _ in range(100) for o in engine.step()):
        assert out.request_id not in (ids[2], ids[5])
        outputs[out.request_id].extend(out.new_token_ids)
    assert not engine.has_unfinished()
    assert [outputs[ids[i]] for i in (0, 1, 3, 4)] == [alone[i] for i in (0, 1, 3, 4)]
    assert engine.kv.num_free_blocks == engine.num_blocks
    with pytest.raises(UnknownRequest, match="unknown request"):
        engine.abort(ids[2])


def test_steps_mix_prompt_chunks_and_decodes_by_default_on_the_portable_path():
    # the portable op attends decodes and prompt chunks in separate groups, so mixing costs no padding there
    engine = _engine(enable_prefix_caching=False, max_num_batched_tokens=24)
    assert engine.session.session.portable_nodes and engine.mixed_steps is True
    ids = [engine.add_request(p, SamplingParams(max_new_tokens=4)) for p in ([1, 2, 3], [4, 5, 6, 7, 8])]
    engine.step()  # both prompts
    engine.add_request(list(range(10, 30)), SamplingParams(max_new_tokens=2))
    plan = engine.scheduler.schedule()  # peek at the next step: two decodes and the new prompt
    assert sorted(c.num_tokens for c in plan.chunks) == [1, 1, 20]
    assert {c.request.request_id for c in plan.chunks} >= set(ids)
    assert _engine(mixed_steps=False).mixed_steps is False


def test_requests_past_the_rotary_table_are_refused():
    """RoPE in the op reads cos_cache[position] unchecked on CUDA: the engine refuses what would run past it."""
    from support.parity import FIXTURES

    from ortpa.rewriter.pipeline import convert
    from ortpa.runtime.engine import RequestTooLong, rotary_table_rows

    fixture = str(FIXTURES / "llama_sdpa_op18.onnx")
    in_op = convert(fixture, rope_in_op=True, max_positions=24)
    assert rotary_table_rows(in_op) == 24
    assert rotary_table_rows(convert(fixture)) is None  # RoPE in the graph: computed per position, no table
    engine = _engine(in_op)
    prompt = list(range(1, 11))
    # positions 0..23: 10 prompt tokens, then 14 of the 15 generated tokens are fed back
    assert len(engine.generate([prompt], SamplingParams(max_new_tokens=15))[0]) == 15
    with pytest.raises(RequestTooLong, match="24 positions") as info:
        engine.add_request(prompt, SamplingParams(max_new_tokens=16))
    assert isinstance(info.value, RequestTooLarge) and info.value.tokens == 25
    assert not engine.has_unfinished()


@pytest.mark.parametrize("chosen", ["0", "1"])
def test_cpu_pool_spinning_is_the_callers_choice(chosen):
    """The Engine's CPU session keeps the caller's session.intra_op.allow_spinning, either way."""
    import onnxruntime as ort

    key = "session.intra_op.allow_spinning"
    opts = ort.SessionOptions()
    opts.add_session_config_entry(key, chosen)
    engine = _engine(sess_options=opts)
    assert engine.session.session._sess.get_session_options().get_session_config_entry(key) == chosen
