"""A live ``ortpa serve``: log-probabilities (chat, completions, echo = prompt scoring) against the dense original
run by ONNX Runtime, and the sampling controls against the Engine given the same SamplingParams."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortpa.parity.greedy import dense_forward, open_dense
from ortpa.tolerances import logprob_bound
from serve.helpers import EOS, MODEL_NAME, SOURCE, request

PROMPT_IDS = [[0, 5, 6, 7, 8, 9, 10, 5, 6], [0, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]]


@pytest.fixture(scope="module")
def dense():
    return open_dense(SOURCE)


def _ref_logprobs(dense, tokens: list[int]) -> tuple[np.ndarray, float]:
    """Raw log-probabilities ``[len(tokens), vocab]`` of the dense original, and the float16 cache's bound."""
    logits = dense_forward(dense.session, tokens, interface=dense.interface).astype(np.float64)
    shifted = logits - logits.max(axis=1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True)), logprob_bound("float16")


def test_echo_with_max_tokens_0_scores_each_prompt_token(client, dense, tokenizer):
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT_IDS, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    assert got.usage.completion_tokens == 0
    for choice in sorted(got.choices, key=lambda c: c.index):
        ids = PROMPT_IDS[choice.index]
        ref, bound = _ref_logprobs(dense, ids)
        lp = choice.logprobs
        assert choice.finish_reason == "length" and choice.text == tokenizer.decode(ids)
        assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        errors = [abs(lp.token_logprobs[p] - ref[p - 1, ids[p]]) for p in range(1, len(ids))]
        assert max(errors) <= bound, (max(errors), bound)
        for p in range(1, len(ids)):
            best = np.argsort(-ref[p - 1], kind="stable")[:2]
            alts = lp.top_logprobs[p]
            assert {tokenizer.decode([int(t)]) for t in best} | {lp.tokens[p]} == set(alts)
        assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))


def test_lm_eval_request_shape_scores_prompt_and_greedy_token(server, dense):
    """lm-evaluation-harness' local-completions sends echo, logprobs 1 and max_tokens 1 and reads
    token_logprobs[ctxlen:-1] and whether each equals the best of its top_logprobs."""
    body = {"model": MODEL_NAME, "prompt": PROMPT_IDS, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    status, _, raw = request("POST", server.api + "/completions", json.dumps(body).encode())
    assert status == 200, raw
    for choice in json.loads(raw)["choices"]:
        ids = PROMPT_IDS[choice["index"]]
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + 1
        ref, bound = _ref_logprobs(dense, ids)
        generated = lp["token_logprobs"][-1]
        assert generated == max(lp["top_logprobs"][-1].values())  # greedy: the chosen token is the best
        assert abs(generated - ref[-1].max()) <= bound


def test_chat_logprobs_streamed_equal_whole_and_the_model(client, dense, tokenizer):
    kw = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 8}
    kw |= {"temperature": 0, "logprobs": True, "top_logprobs": 3}
    whole = client.chat.completions.create(**kw)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    streamed = [e for chunk in client.chat.completions.create(**kw, stream=True) for c in chunk.choices
                if c.logprobs is not None for e in c.logprobs.content]  # fmt: skip
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    prompt = tokenizer.encode("<s>user hello world assistant", add_special_tokens=False).ids
    generated = [tokenizer.token_to_id(e.token) for e in content]
    ref, bound = _ref_logprobs(dense, prompt + generated)
    for k, e in enumerate(content):
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob  # greedy picks the best
        assert abs(e.logprob - ref[len(prompt) - 1 + k, generated[k]]) <= bound
        assert e.bytes == list(e.token.encode())


def test_completion_logprobs_streamed_equal_whole(client):
    kw = {"model": MODEL_NAME, "prompt": "the paged cache", "max_tokens": 6, "temperature": 0, "logprobs": 2}
    whole = client.completions.create(**kw).choices[0].logprobs
    parts = [c.logprobs for chunk in client.completions.create(**kw, stream=True) for c in chunk.choices if c.logprobs]
    assert [t for p in parts for t in p.tokens] == whole.tokens
    assert [v for p in parts for v in p.token_logprobs] == whole.token_logprobs
    assert [o for p in parts for o in p.text_offset] == whole.text_offset


@pytest.fixture(scope="module")
def engine(model_folder):
    from ortpa.runtime.engine import Engine

    return Engine(model_folder / "model.onnx", num_blocks=64, providers=["CPUExecutionProvider"])


CONTROLS = [
    ({"logit_bias": {"7": 100}}, {"logit_bias": {7: 100.0}}),
    ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, {"frequency_penalty": 1.5, "presence_penalty": 0.5}),
    ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
    ({"min_tokens": 4, "stop_token_ids": ["FIRST"]}, {"min_tokens": 4}),  # FIRST: the first greedy token
    ({"temperature": 0.9, "seed": 5, "top_k": 20, "frequency_penalty": -0.5}, {"temperature": 0.9, "seed": 5,
     "top_k": 20, "frequency_penalty": -0.5}),
]  # fmt: skip


@pytest.mark.parametrize(("body", "params"), CONTROLS, ids=[json.dumps(b) for b, _ in CONTROLS])
def test_sampling_controls_give_the_engine_tokens(server, engine, tokenizer, body, params):
    from ortpa.runtime.engine import SamplingParams

    first = engine.generate([PROMPT_IDS[0]], SamplingParams(max_new_tokens=1))[0][0]
    if "stop_token_ids" in body:
        body = body | {"stop_token_ids": [first]}
    stops = (EOS, *body.get("stop_token_ids", []))
    req = {"model": MODEL_NAME, "prompt": PROMPT_IDS[0], "max_tokens": 8, "temperature": 0, "logprobs": 0} | body
    status, _, raw = request("POST", server.api + "/completions", json.dumps(req).encode())
    assert status == 200, raw
    got = [tokenizer.token_to_id(t) for t in json.loads(raw)["choices"][0]["logprobs"]["tokens"]]
    params = SamplingParams(**{"max_new_tokens": 8, "stop_token_ids": stops} | params)
    assert got == engine.generate([PROMPT_IDS[0]], params)[0]
    plain = engine.generate([PROMPT_IDS[0]], SamplingParams(max_new_tokens=8, stop_token_ids=stops))[0]
    assert got != plain  # each control changes this prompt's tokens: the field reached the sampler


def test_stop_token_ids_end_a_choice_and_min_tokens_defers_them(client, tokenizer):
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT_IDS[0], max_tokens=8, temperature=0, logprobs=0)
    stop = {"stop_token_ids": [tokenizer.token_to_id(plain.choices[0].logprobs.tokens[0])]}
    kw = {"model": MODEL_NAME, "prompt": PROMPT_IDS[0], "max_tokens": 8, "temperature": 0}
    stopped = client.completions.create(**kw, extra_body=stop)
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 1
    assert stopped.choices[0].text == ""  # a stop token is not text, like EOS
    later = client.completions.create(**kw, extra_body=stop | {"min_tokens": 3})
    assert later.usage.completion_tokens >= 3


def test_tokenize_detokenize_and_tokenizer_info(server, tokenizer):
    def post(path: str, body: dict) -> dict:
        status, _, raw = request("POST", server.base + path, json.dumps(body).encode())
        assert status == 200, raw
        return json.loads(raw)

    got = post("/tokenize", {"model": MODEL_NAME, "prompt": "hello paged world", "return_token_strs": True})
    assert got["tokens"] == tokenizer.encode("hello paged world").ids and got["count"] == 3
    assert got["token_strs"] == ["hello", "paged", "world"] and got["max_model_len"] == 256
    chat = post("/tokenize", {"messages": [{"role": "user", "content": "hello"}]})
    assert chat["tokens"] == tokenizer.encode("<s>user hello assistant", add_special_tokens=False).ids
    assert post("/detokenize", {"tokens": got["tokens"]})["prompt"] == "hello paged world"
    status, _, raw = request("GET", server.base + "/tokenizer_info", None)
    info = json.loads(raw)
    assert status == 200 and info["eos_token"] == "</s>" and "messages" in info["chat_template"]


def test_access_log_names_each_request(server, client):
    got = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=3, temperature=0)
    lines = server.lines_with(got.id)
    assert len(lines) == 1 and " POST /v1/completions 200 " in lines[0], lines
    assert f"completion_tokens={got.usage.completion_tokens}" in lines[0] and lines[0].endswith("s")


def test_echo_streamed_equals_whole_with_usage_in_every_chunk(client, tokenizer):
    kw = {"model": MODEL_NAME, "prompt": PROMPT_IDS[0], "max_tokens": 4, "temperature": 0, "echo": True}
    whole = client.completions.create(**kw, logprobs=1).choices[0]
    assert len(whole.logprobs.tokens) == 9 + 4
    ids = [tokenizer.token_to_id(t) for t in whole.logprobs.tokens]
    assert ids[:9] == PROMPT_IDS[0] and whole.text == tokenizer.decode(ids)  # one text: the space at the junction
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(**kw, logprobs=1, stream=True, stream_options=options))
    assert "".join(c.text for ch in chunks for c in ch.choices) == whole.text
    parts = [c.logprobs for ch in chunks for c in ch.choices if c.logprobs]
    assert [v for p in parts for v in p.token_logprobs] == whole.logprobs.token_logprobs
    counts = [ch.usage.completion_tokens for ch in chunks]
    assert all(ch.usage is not None for ch in chunks) and counts == sorted(counts) and counts[-1] == 4
    assert chunks[-1].choices == []
