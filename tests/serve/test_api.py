"""A live ``ortpa serve`` driven by the official ``openai`` client: completions and chat, streamed and not."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from ortpa.serve.chat import ChatTemplate
from serve.helpers import CHAT_TEMPLATE, CONTEXT, MODEL_NAME, get, metric

PROMPTS = ["hello world", "the paged latent cache", "hello", " ".join(["cache", "world"] * 12)]  # last: 24 tokens


def _stream_text(stream, chat: bool = False) -> tuple[dict[int, str], dict[int, str | None], list]:
    texts: dict[int, str] = {}
    reasons: dict[int, str | None] = {}
    chunks = list(stream)
    for chunk in chunks:
        assert len({c.index for c in chunk.choices}) == len(chunk.choices), "a choice twice in one chunk"
        for c in chunk.choices:
            piece = (c.delta.content or "") if chat else c.text
            texts[c.index] = texts.get(c.index, "") + piece
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return texts, reasons, chunks


def test_health_and_models(server, client):
    assert get(server.base + "/health")[0] == 200
    (card,) = client.models.list().data
    assert card.id == MODEL_NAME and card.owned_by == "ortpa"


def test_greedy_completions_equal_ortpa_generate(client, model_folder, capsys):
    from ortpa.cli import main

    argv = ["generate", str(model_folder), "--max-new-tokens", "12", "--json", "--quiet"]
    for p in PROMPTS:
        argv += ["--prompt", p]
    assert main(argv) == 0
    expected = json.loads(capsys.readouterr().out)["texts"]
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == expected
    assert all(c.text for c in got.choices)  # the model says something: an empty text would prove little


def test_completion_streamed_equals_whole(client, tokenizer):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0)
    texts, reasons, chunks = _stream_text(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPTS[1],
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert texts == {0: whole.choices[0].text} and reasons == {0: whole.choices[0].finish_reason}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    n_prompt = len(tokenizer.encode(PROMPTS[1]).ids)
    assert (
        whole.usage.prompt_tokens == n_prompt and whole.usage.total_tokens == n_prompt + whole.usage.completion_tokens
    )


def test_prompt_forms_and_n(client, tokenizer):
    ids = tokenizer.encode(PROMPTS[0]).ids
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    for prompt in (ids, [ids], [PROMPTS[0]]):
        got = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0)
        assert [c.text for c in got.choices] == [by_text.choices[0].text]
    pair = [ids, tokenizer.encode(PROMPTS[2]).ids]
    two = client.completions.create(model=MODEL_NAME, prompt=pair, max_tokens=6, temperature=1.0, seed=3, n=2)
    assert sorted(c.index for c in two.choices) == [0, 1, 2, 3]
    again = client.completions.create(model=MODEL_NAME, prompt=pair, max_tokens=6, temperature=1.0, seed=3, n=2)
    assert [c.text for c in two.choices] == [c.text for c in again.choices]  # seeded: reproducible
    assert two.choices[0].text != two.choices[1].text  # n choices of one prompt draw differently


def test_chat_streamed_and_not(client, tokenizer):
    messages = [{"role": "system", "content": "hello"}, {"role": "user", "content": "the paged cache"}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0)
    rendered = ChatTemplate(CHAT_TEMPLATE, {"bos_token": "<s>"}).render(messages)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False).ids)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content
    completion = client.completions.create(model=MODEL_NAME, prompt=rendered, max_tokens=10, temperature=0)
    assert whole.choices[0].message.content == completion.choices[0].text  # the template is the only difference
    texts, reasons, chunks = _stream_text(
        client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0, stream=True),
        chat=True,
    )
    assert texts == {0: whole.choices[0].message.content} and reasons == {0: whole.choices[0].finish_reason}
    assert chunks[0].choices[0].delta.role == "assistant"


def test_stop_strings(client):
    whole = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0]
    words = whole.text.split(" ")
    stop = " ".join(words[3:5])  # two tokens of the output: a stop string spanning tokens
    cut = whole.text[: whole.text.index(stop)]
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=[stop])
    assert (got.choices[0].text, got.choices[0].finish_reason) == (cut, "stop")
    texts, reasons, chunks = _stream_text(
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop, stream=True
        )
    )
    assert texts == {0: cut} and reasons == {0: "stop"}
    assert not any(words[3] in c.choices[0].text for c in chunks if c.choices), "part of the stop string was sent"


def test_concurrent_streams_each_equal_its_request_alone(server, client):
    """40 streams at once, greedy and seeded sampling, prompts of 1 to 40 tokens (past two 16-token blocks)."""
    from openai import AsyncOpenAI

    def params(i: int) -> dict:
        prompt = " ".join(["hello", "world", "the", "paged", "latent", "cache"][j % 6] for j in range(i + 1))
        sampled = {"temperature": 0.9, "top_p": 0.9, "top_k": 20, "seed": i} if i % 2 else {"temperature": 0}
        return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8 + i % 9, **sampled}

    requests = [params(i) for i in range(40)]
    alone = []
    for r in requests:
        extra = {"top_k": r.pop("top_k")} if "top_k" in r else {}
        alone.append(client.completions.create(**r, extra_body=extra).choices[0].text)
        r.update(extra)

    async def together() -> list[str]:
        aclient = AsyncOpenAI(base_url=server.api, api_key="unused", timeout=60, max_retries=0)

        async def one(r: dict) -> str:
            r = dict(r)
            extra = {"top_k": r.pop("top_k")} if "top_k" in r else {}
            text = ""
            async for chunk in await aclient.completions.create(**r, stream=True, extra_body=extra):
                text += "".join(c.text for c in chunk.choices)
            return text

        try:
            return await asyncio.gather(*(one(r) for r in requests))
        finally:
            await aclient.close()

    assert asyncio.run(together()) == alone


def test_dropped_stream_is_aborted_and_frees_its_blocks(server, client):
    finished = 'ortpa_requests_finished_total{finish_reason="abort"}'
    aborted_before = _labelled(server, finished)
    generated_before = metric(server.base, "ortpa_generation_tokens_total")
    stream = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=CONTEXT - 30, temperature=0, stream=True
    )
    next(iter(stream))
    assert metric(server.base, "ortpa_kv_blocks_used") > 0  # text arrives while the request still runs
    stream.close()  # the client goes away mid-stream
    deadline = time.monotonic() + 10
    while metric(server.base, "ortpa_kv_blocks_used") > 0 or metric(server.base, "ortpa_requests_running") > 0:
        assert time.monotonic() < deadline, "blocks of a dropped stream still held after 10 s"
        time.sleep(0.05)
    assert _labelled(server, finished) == aborted_before + 1
    assert metric(server.base, "ortpa_generation_tokens_total") - generated_before < CONTEXT - 30  # cut short
    assert get(server.base + "/health")[0] == 200


def test_metrics_exposed(server, client):
    before = metric(server.base, "ortpa_generation_tokens_total")
    prompt_before = metric(server.base, "ortpa_prompt_tokens_total")
    ttft = metric(server.base, "ortpa_time_to_first_token_seconds_count")
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0)
    assert metric(server.base, "ortpa_generation_tokens_total") == before + 5
    assert metric(server.base, "ortpa_prompt_tokens_total") == prompt_before + 2
    assert metric(server.base, "ortpa_time_to_first_token_seconds_count") == ttft + 1
    assert metric(server.base, "ortpa_inter_token_latency_seconds_count") >= 4
    assert metric(server.base, "ortpa_kv_blocks_total") == 128
    for name in ("ortpa_requests_running", "ortpa_requests_waiting", "ortpa_kv_blocks_used"):
        assert metric(server.base, name) == 0


def _labelled(server, sample: str) -> float:
    _, text = get(server.base + "/metrics")
    for line in text.decode().splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[1])
    return 0.0


@pytest.mark.parametrize("chat", [False, True])
def test_openai_client_errors(client, chat):
    """The client's own exception types: 400 -> BadRequestError, 404 -> NotFoundError."""
    import openai

    create = client.chat.completions.create if chat else client.completions.create
    field = {"messages": [{"role": "user", "content": "hello"}]} if chat else {"prompt": "hello"}
    with pytest.raises(openai.BadRequestError) as bad:
        create(model=MODEL_NAME, max_tokens=0, **field)
    assert bad.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        create(model="gpt-4", max_tokens=2, **field)


def test_dropped_non_streamed_request_is_aborted_too(server):
    """A client that closes its connection while waiting for a whole completion frees the engine at once."""
    import socket

    finished = 'ortpa_requests_finished_total{finish_reason="abort"}'
    aborted_before = _labelled(server, finished)
    body = json.dumps({"model": MODEL_NAME, "prompt": PROMPTS[3], "max_tokens": CONTEXT - 30, "temperature": 0})
    host, port = server.base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
        deadline = time.monotonic() + 10
        while metric(server.base, "ortpa_requests_running") == 0:  # wait until it runs, then hang up
            assert time.monotonic() < deadline, "the request never started"
            time.sleep(0.01)
    deadline = time.monotonic() + 10
    while metric(server.base, "ortpa_kv_blocks_used") > 0 or _labelled(server, finished) == aborted_before:
        assert time.monotonic() < deadline, "a dropped request still ran 10 s later"
        time.sleep(0.05)
    assert get(server.base + "/health")[0] == 200
