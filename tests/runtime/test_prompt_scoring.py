"""Prompt scoring in one pass: a converted model computes the logits rows a step names (``logits_indices``), so
a scored prompt prefills in chunks; its log-probabilities equal the dense original's and those of scoring one
token per step (the model without the input), within the cache dtype's bound."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
import pytest

import ortpa
from ortpa.parity.greedy import dense_forward, open_dense
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.testing.logits_rows import without_logits_indices
from ortpa.tolerances import logprob_bound

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LLAMA = FIXTURES / "llama_sdpa_op18.onnx"  # float32: auto gives float16 caches
BUDGET = 16
RNG = np.random.default_rng(7)
PROMPTS = [[int(t) for t in RNG.integers(1, 200, n)] for n in (41, 23)]  # past the step budget, different lengths


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> onnx.ModelProto:
    out = tmp_path_factory.mktemp("scoring") / "model.onnx"
    ortpa.convert_file(LLAMA, out, verify=False)
    return onnx.load(str(out))


def _engine(model: onnx.ModelProto) -> Engine:
    return Engine(model, num_blocks=64, block_size=16, max_num_batched_tokens=BUDGET, enable_prefix_caching=False)


def _score(engine: Engine) -> tuple[list[list[float]], int, list[int]]:
    """Both prompts scored, batched with a third that generates: (log-probs per prompt, steps, generated)."""
    params = [SamplingParams(max_new_tokens=0, prompt_logprobs=0)] * 2 + [SamplingParams(max_new_tokens=4)]
    ids = [engine.add_request(p, s) for p, s in zip([*PROMPTS, PROMPTS[1][:9]], params, strict=True)]
    scores: dict[str, list[float]] = {}
    generated: list[int] = []
    steps = 0
    while engine.has_unfinished():
        steps += 1
        for o in engine.step():
            if o.prompt_logprobs is not None:
                scores[o.request_id] = [lp.logprob for lp in o.prompt_logprobs[1:]]
            if o.request_id == ids[2]:
                generated += o.new_token_ids
    return [scores[i] for i in ids[:2]], steps, generated


def test_a_scored_prompt_is_one_pass_and_equals_the_original_and_one_token_per_step(converted):
    assert "logits_indices" in {i.name for i in converted.graph.input}
    one_pass, steps, generated = _score(_engine(converted))
    per_token, steps_before, generated_before = _score(_engine(without_logits_indices(converted)))
    assert steps <= math.ceil((sum(map(len, PROMPTS)) + 9) / BUDGET) + 4, steps  # chunks of the budget, + decodes
    assert steps_before >= max(map(len, PROMPTS)), steps_before  # one token per step: the longest prompt's length
    assert generated == generated_before  # the generating neighbour does not notice
    bound = logprob_bound("float16")
    dense = open_dense(LLAMA)
    for prompt, got, before in zip(PROMPTS, one_pass, per_token, strict=True):
        logits = dense_forward(dense.session, prompt, interface=dense.interface).astype(np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_softmax = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        want = [log_softmax[pos - 1, prompt[pos]] for pos in range(1, len(prompt))]
        assert len(got) == len(want) == len(before)
        np.testing.assert_allclose(got, want, rtol=0, atol=bound)
        np.testing.assert_allclose(got, before, rtol=0, atol=bound)


def test_decoding_computes_one_row_per_sequence_and_genai_may_omit_the_input(converted):
    """Without the feed (genai, or a step scoring nothing) the model returns one row per sequence; the feed
    names any rows, in its order."""
    session = ortpa.InferenceSession(converted.SerializeToString(), providers=["CPUExecutionProvider"])
    names = {i.name for i in session.get_inputs()}
    assert "logits_indices" not in names  # not required: its default is the empty initializer
    inputs = session.get_inputs()
    caches = {i.name: np.zeros([4, 16, *i.shape[2:]], np.float16) for i in inputs if "past_key_values" in i.name}
    tokens = np.array(PROMPTS[0][:5] + PROMPTS[1][:3], np.int64)
    feeds = {
        "input_ids": tokens,
        "cumulative_sequence_lengths": np.array([0, 5, 8], np.int32),
        "past_sequence_lengths": np.array([0, 0], np.int32),
        "block_table": np.array([[0, -1], [1, -1]], np.int32),
        "attention_metadata": np.array([5, 5, 5], np.int32),
        **caches,
    }
    feeds = {k: v for k, v in feeds.items() if k in names}
    (last,) = session.run(["logits"], feeds)
    (every,) = session.run(["logits"], {**feeds, "logits_indices": np.arange(8, dtype=np.int64)})
    (picked,) = session.run(["logits"], {**feeds, "logits_indices": np.array([6, 1], np.int64)})
    assert last.shape[0] == 2 and every.shape[0] == 8
    np.testing.assert_array_equal(last, every[[4, 7]])
    np.testing.assert_array_equal(picked, every[[6, 1]])
