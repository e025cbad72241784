"""The sampler's logits controls and log-probabilities: each against a per-row reference written from the
definitions (OpenAI's penalties, vLLM's repetition penalty), batched = alone, and the Engine's prompt scoring
against the dense NumPy model."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
import pytest

from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.runtime.logits_processing import RowContext, process_logits
from ortpa.runtime.sampling import InvalidSamplingParams, Sampler, sample_rows
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm, toy_lm_reference, toy_lm_weights
from ortpa.tolerances import logprob_bound, tol_for

CPU = ["CPUExecutionProvider"]
CFG = ToyLMConfig()
WEIGHTS = toy_lm_weights(CFG)
V = 12


def _ref_log_softmax(row) -> np.ndarray:
    row = np.asarray(row, np.float64)
    return row - np.log(np.sum(np.exp(row - row.max()))) - row.max()


def _ref_process(row, params: SamplingParams, tokens, prompt_len) -> np.ndarray:
    """One row, from the definitions, element by element."""
    out = np.asarray(row, np.float64).copy()
    for t, b in params.logit_bias:
        out[t] += b
    seen, produced = set(tokens), list(tokens[prompt_len:])
    for t in range(len(out)):
        if params.repetition_penalty != 1.0 and t in seen:
            out[t] = out[t] / params.repetition_penalty if out[t] > 0 else out[t] * params.repetition_penalty
        c = produced.count(t)
        out[t] -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    if len(produced) < params.min_tokens:
        for t in params.stop_token_ids:
            out[t] = -np.inf
    return out


class _Only:
    """A constraint allowing a fixed set of tokens, terminated after ``length`` tokens."""

    def __init__(self, allowed: set[int], length: int) -> None:
        self.allowed, self.length, self.seen = allowed, length, []

    def allowed_mask(self, vocab_size: int) -> np.ndarray:
        mask = np.zeros(vocab_size, bool)
        mask[list(self.allowed)] = True
        return mask

    def advance(self, token_id: int) -> None:
        self.seen.append(token_id)

    def is_terminated(self) -> bool:
        return len(self.seen) >= self.length


CASES = [
    SamplingParams(),
    SamplingParams(logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(frequency_penalty=0.9, presence_penalty=-0.4),
    SamplingParams(min_tokens=5, stop_token_ids=(0, 2)),
    SamplingParams(repetition_penalty=0.6, frequency_penalty=-1.5, logit_bias=[(1, 2.5)], min_tokens=1,
                   stop_token_ids=(9,)),
]  # fmt: skip


def _rows(seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 2, (len(CASES), V)).astype(np.float32)
    histories = [[int(t) for t in rng.integers(0, V, 8)] for _ in CASES]
    return logits, [RowContext(p, h, 5) for p, h in zip(CASES, histories, strict=True)]


def test_controls_follow_their_definitions_row_by_row():
    logits, ctx = _rows()
    got = process_logits(logits, ctx)
    for i, (p, c) in enumerate(zip(CASES, ctx, strict=True)):
        rtol, atol = tol_for(np.float32)  # the processors compute in float32
        expected = _ref_process(logits[i], p, c.tokens, 5)
        np.testing.assert_allclose(got[i], expected, rtol=rtol, atol=atol, err_msg=repr(p))
    assert not np.array_equal(got[1:], logits[1:])  # every case but the first changes its row
    np.testing.assert_array_equal(got[0], logits[0])
    np.testing.assert_array_equal(logits, _rows()[0])  # the input is not modified


def test_a_row_is_processed_the_same_alone_and_batched():
    logits, ctx = _rows(1)
    together = process_logits(logits, ctx)
    for i in range(len(CASES)):
        np.testing.assert_array_equal(process_logits(logits[i : i + 1], ctx[i : i + 1])[0], together[i])
        np.testing.assert_array_equal(process_logits(logits[::-1], ctx[::-1])[len(CASES) - 1 - i], together[i])


def test_sampled_tokens_and_logprobs_are_the_same_alone_and_batched():
    logits, ctx = _rows(2)
    params = [
        dataclasses.replace(p, temperature=0.8 * (i % 2), seed=i, top_k=i % 3, logprobs=i % 4)
        for i, p in enumerate(CASES)
    ]
    ctx = [RowContext(p, c.tokens, c.prompt_len) for p, c in zip(params, ctx, strict=True)]
    batched = sample_rows(logits, [Sampler(p) for p in params], ctx)
    alone = [sample_rows(logits[i : i + 1], [Sampler(p)], ctx[i : i + 1])[0] for i, p in enumerate(params)]
    assert batched == alone
    for i, s in enumerate(batched):
        ref = _ref_log_softmax(logits[i])  # raw: before bias, penalties, masks and temperature
        assert s.logprobs.token_id == s.token_id and len(s.logprobs.top) == params[i].logprobs
        assert s.logprobs.logprob == pytest.approx(ref[s.token_id], abs=1e-6)
        assert [t for t, _ in s.logprobs.top] == list(np.argsort(-ref, kind="stable")[: params[i].logprobs])
        assert s.logprobs.rank == 1 + int(np.sum(ref > ref[s.token_id]))
        if params[i].greedy:
            assert s.token_id == int(np.argmax(_ref_process(logits[i], params[i], ctx[i].tokens, 5)))


def test_logit_bias_and_min_tokens_steer_greedy_choice():
    row = np.array([[0.0, 3.0, 1.0, 2.0]], np.float32)
    ctx = lambda p: [RowContext(p, [0, 1], 2)]  # noqa: E731  (nothing generated yet)
    pick = lambda p: sample_rows(row, [Sampler(p)], ctx(p))[0].token_id  # noqa: E731
    assert pick(SamplingParams()) == 1
    assert pick(SamplingParams(logit_bias={0: 100.0})) == 0
    assert pick(SamplingParams(min_tokens=1, stop_token_ids=(1,))) == 3
    assert pick(SamplingParams(min_tokens=0, stop_token_ids=(1,))) == 1


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("logit_bias", {3: 101.0}),
        ("logit_bias", {-1: 1.0}),
        ("min_tokens", -1),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
        ("constraint", object()),
    ],
)
def test_bad_controls_raise_typed_errors(field, value):
    with pytest.raises(InvalidSamplingParams, match=f"SamplingParams.{field}: expected"):
        SamplingParams(**{field: value})


def test_max_new_tokens_zero_only_scores_a_prompt():
    with pytest.raises(InvalidSamplingParams, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)
    assert SamplingParams(max_new_tokens=0, prompt_logprobs=0).max_new_tokens == 0


def _engine(logits_mode: str, **kw) -> Engine:
    cfg = ToyLMConfig(logits=logits_mode)
    model = build_toy_lm(cfg, WEIGHTS)
    # "indices" is a converted default ("last") model that also takes logits_indices
    onnx.helper.set_model_props(model, {"ortpa.logits": "all" if logits_mode == "all" else "last"})
    return Engine(model, num_blocks=64, block_size=4, providers=CPU, max_num_batched_tokens=16, **kw)


PROMPTS = [[5, 9, 3], [int(t) for t in np.random.default_rng(3).integers(0, CFG.vocab, 37)], [7, 1]]  # 37 > budget


@pytest.mark.parametrize("logits_mode", ["last", "all", "indices"])
def test_prompt_logprobs_equal_the_dense_model_batched_with_generation(logits_mode):
    engine = _engine(logits_mode)
    # the third request generates alongside the two scored ones; the scored prompts share a cached prefix
    engine.generate([PROMPTS[1][:20]], SamplingParams(max_new_tokens=1))  # fills the prefix cache
    params = [
        SamplingParams(max_new_tokens=0, prompt_logprobs=2),
        SamplingParams(max_new_tokens=3, prompt_logprobs=0, logprobs=1),
        SamplingParams(max_new_tokens=6),
    ]
    ids = [engine.add_request(p, s) for p, s in zip(PROMPTS, params, strict=True)]
    outs: dict[str, list] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    for prompt, rid, p in zip(PROMPTS, ids, params, strict=True):
        firsts = [o for o in outs[rid] if o.prompt_logprobs is not None]
        if p.prompt_logprobs is None:
            assert not firsts
            continue
        (first,) = firsts
        assert first is outs[rid][0] and first.prompt_logprobs[0] is None
        generated = [t for o in outs[rid] for t in o.new_token_ids]
        ref = toy_lm_reference(CFG, WEIGHTS, prompt + generated)
        bound = logprob_bound("float16")
        for pos, lp in enumerate(first.prompt_logprobs[1:], start=1):
            expected = _ref_log_softmax(ref[pos - 1])
            assert lp.token_id == prompt[pos] and len(lp.top) == p.prompt_logprobs
            assert abs(lp.logprob - expected[prompt[pos]]) <= bound, (logits_mode, pos)
        for k, o in enumerate(o for o in outs[rid] if o.new_token_ids):
            expected = _ref_log_softmax(ref[len(prompt) - 1 + k])
            (lp,) = o.logprobs
            assert abs(lp.logprob - expected[lp.token_id]) <= bound and len(lp.top) == 1
    assert len([t for o in outs[ids[0]] for t in o.new_token_ids]) == 0 and outs[ids[0]][-1].finish_reason == "length"
    assert engine.num_available_blocks == engine.num_blocks


def test_scored_tokens_equal_those_generated_alone():
    engine = _engine("last")
    alone = engine.generate([PROMPTS[2]], SamplingParams(max_new_tokens=6))
    scored = SamplingParams(max_new_tokens=0, prompt_logprobs=1)
    both = engine.generate([PROMPTS[1], PROMPTS[2]], [scored, SamplingParams(max_new_tokens=6)])
    assert both == [[], alone[0]]


def test_a_constraint_limits_tokens_and_ends_the_request():
    engine = _engine("last")
    allowed = {4, 8, 15}
    only = _Only(allowed, 3)
    (out,) = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=10, constraint=only))
    assert len(out) == 3 and set(out) <= allowed and only.seen == out
    nothing = _Only(set(), 3)
    rid = engine.add_request(PROMPTS[0], SamplingParams(max_new_tokens=10, constraint=nothing))
    (o,) = engine.step()
    assert o.request_id == rid and o.new_token_ids == () and o.finish_reason == "stop"
