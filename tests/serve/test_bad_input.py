"""Every bad input gets OpenAI's error body with the right status, and the server stays healthy after each."""

from __future__ import annotations

import json

import pytest

from serve.helpers import CONTEXT, MODEL_NAME, get, request

OK = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


def _with(base: dict, **change) -> bytes:
    body = {**base, **change}
    return json.dumps({k: v for k, v in body.items() if v is not _DROP}).encode()


_DROP = object()

# (route, raw body, status, param the error names)
CASES = {
    "malformed JSON": ("completions", b'{"model": "tiny", ', 400, None),
    "empty body": ("completions", b"", 400, None),
    "not an object": ("completions", b"[1, 2]", 400, None),
    "model missing": ("completions", _with(OK, model=_DROP), 400, "model"),
    "prompt missing": ("completions", _with(OK, prompt=_DROP), 400, "prompt"),
    "prompt ill-typed": ("completions", _with(OK, prompt=5), 400, "prompt"),
    "prompt mixed list": ("completions", _with(OK, prompt=[[1, 2], "hello"]), 400, "prompt"),
    "prompt empty list": ("completions", _with(OK, prompt=[]), 400, "prompt"),
    "prompt empty string": ("completions", _with(OK, prompt=""), 400, "prompt"),
    "token id past vocab": ("completions", _with(OK, prompt=[5, 300]), 400, "prompt"),
    "negative token id": ("completions", _with(OK, prompt=[-1]), 400, "prompt"),
    "max_tokens a string": ("completions", _with(OK, max_tokens="5"), 400, "max_tokens"),
    "max_tokens 0": ("completions", _with(OK, max_tokens=0), 400, "max_tokens"),
    "max_tokens negative": ("completions", _with(OK, max_tokens=-3), 400, "max_tokens"),
    "past the context": ("completions", _with(OK, max_tokens=CONTEXT), 400, "max_tokens"),
    "stream not a bool": ("completions", _with(OK, stream=1), 400, "stream"),
    "temperature a string": ("completions", _with(OK, temperature="hot"), 400, "temperature"),
    "temperature negative": ("completions", _with(OK, temperature=-1.0), 400, "temperature"),
    "top_p 0": ("completions", _with(OK, top_p=0.0), 400, "top_p"),
    "top_k negative": ("completions", _with(OK, top_k=-5), 400, "top_k"),
    "stop ill-typed": ("completions", _with(OK, stop=3), 400, "stop"),
    "seed negative": ("completions", _with(OK, seed=-1), 400, "seed"),
    "n 0": ("completions", _with(OK, n=0), 400, "n"),
    "n too many": ("completions", _with(OK, n=17), 400, "n"),
    "logprobs too many": ("completions", _with(OK, logprobs=21), 400, "logprobs"),
    "logprobs negative": ("completions", _with(OK, logprobs=-1), 400, "logprobs"),
    "logprobs a bool (completions)": ("completions", _with(OK, logprobs=True), 400, "logprobs"),
    "echo not a bool": ("completions", _with(OK, echo="yes"), 400, "echo"),
    "echo with max_tokens negative": ("completions", _with(OK, echo=True, max_tokens=-1), 400, "max_tokens"),
    "best_of": ("completions", _with(OK, best_of=2), 400, "best_of"),
    "presence_penalty past 2": ("completions", _with(OK, presence_penalty=2.5), 400, "presence_penalty"),
    "frequency_penalty a string": ("completions", _with(OK, frequency_penalty="x"), 400, "frequency_penalty"),
    "repetition_penalty 0": ("completions", _with(OK, repetition_penalty=0.0), 400, "repetition_penalty"),
    "logit_bias not ids": ("completions", _with(OK, logit_bias={"abc": 1}), 400, "logit_bias"),
    "logit_bias id past vocab": ("completions", _with(OK, logit_bias={"300": 1}), 400, "logit_bias"),
    "logit_bias past 100": ("completions", _with(OK, logit_bias={"5": 101}), 400, "logit_bias"),
    "logit_bias ill-typed": ("completions", _with(OK, logit_bias=[5]), 400, "logit_bias"),
    "min_tokens negative": ("completions", _with(OK, min_tokens=-1), 400, "min_tokens"),
    "min_tokens past max_tokens": ("completions", _with(OK, min_tokens=3), 400, "min_tokens"),
    "stop_token_ids past vocab": ("completions", _with(OK, stop_token_ids=[300]), 400, "stop_token_ids"),
    "stop_token_ids ill-typed": ("completions", _with(OK, stop_token_ids="1"), 400, "stop_token_ids"),
    "stream_options.include_usage ill-typed": (
        "completions",
        _with(OK, stream=True, stream_options={"include_usage": "yes"}),
        400,
        "stream_options.include_usage",
    ),
    "stream_options without stream": (
        "completions",
        _with(OK, stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    "stream_options.continuous_usage_stats ill-typed": (
        "completions",
        _with(OK, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": 1}),
        400,
        "stream_options.continuous_usage_stats",
    ),
    "suffix": ("completions", _with(OK, suffix="world"), 400, "suffix"),
    "unknown model": ("completions", _with(OK, model="gpt-4"), 404, "model"),
    "chat: messages missing": ("chat/completions", _with(CHAT, messages=_DROP), 400, "messages"),
    "chat: no messages": ("chat/completions", _with(CHAT, messages=[]), 400, "messages"),
    "chat: content ill-typed": (
        "chat/completions",
        _with(CHAT, messages=[{"role": "user", "content": 5}]),
        400,
        "messages.0.content",
    ),
    "chat: the template refuses a role": (
        "chat/completions",
        _with(CHAT, messages=[{"role": "tool", "content": "x"}]),
        400,
        "messages",
    ),
    "chat: past the context": ("chat/completions", _with(CHAT, max_tokens=CONTEXT), 400, "max_tokens"),
    "chat: logprobs an int": ("chat/completions", _with(CHAT, logprobs=2), 400, "logprobs"),
    "chat: top_logprobs without logprobs": ("chat/completions", _with(CHAT, top_logprobs=2), 400, "top_logprobs"),
    "chat: top_logprobs too many": (
        "chat/completions",
        _with(CHAT, logprobs=True, top_logprobs=21),
        400,
        "top_logprobs",
    ),
    "tokenize: neither prompt nor messages": ("/tokenize", b"{}", 400, "prompt"),
    "tokenize: prompt ill-typed": ("/tokenize", b'{"prompt": 5}', 400, "prompt"),
    "tokenize: unknown model": ("/tokenize", b'{"model": "gpt-4", "prompt": "hello"}', 404, "model"),
    "tokenize: both prompt and messages": (
        "/tokenize",
        b'{"prompt": "hello", "messages": [{"role": "user", "content": "hello"}]}',
        400,
        "prompt",
    ),
    "detokenize: ids past vocab": ("/detokenize", b'{"tokens": [5, 300]}', 400, "tokens"),
    "detokenize: unknown model": ("/detokenize", b'{"model": "gpt-4", "tokens": [5]}', 404, "model"),
    "detokenize: tokens missing": ("/detokenize", b"{}", 400, "tokens"),
    "chat: unknown model": ("chat/completions", _with(CHAT, model="gpt-4"), 404, "model"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input(server, case):
    route, body, status, param = CASES[case]
    url = server.base + route if route.startswith("/") else f"{server.api}/{route}"
    got, _, raw = request("POST", url, body)
    assert got == status, raw
    error = json.loads(raw)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert error["param"] == param, error
    assert get(server.base + "/health")[0] == 200


def test_messages_say_what_was_expected_and_found(server):
    cases = {
        _with(OK, max_tokens="5"): ("max_tokens", "'5'"),
        _with(OK, max_tokens=CONTEXT): ("256", f"{CONTEXT + 1}"),
        _with(OK, prompt=[5, 300]): ("300", "vocabulary"),
        _with(OK, model="gpt-4"): ("gpt-4", MODEL_NAME),
    }
    for body, words in cases.items():
        _, _, raw = request("POST", server.api + "/completions", body)
        message = json.loads(raw)["error"]["message"]
        assert all(w in message for w in words), message


def test_unknown_route_and_method(server):
    status, _, raw = request("GET", server.api + "/nothing", None)
    assert status == 404 and "error" in json.loads(raw)
    status, _, raw = request("GET", server.api + "/completions", None)
    assert status == 405 and "error" in json.loads(raw)


def test_still_serving_after_the_bad_inputs(server):
    status, _, raw = request("POST", server.api + "/completions", _with(OK, temperature=0))
    assert status == 200 and json.loads(raw)["choices"][0]["finish_reason"] in ("stop", "length")
