"""A second server: API key, no chat template, one running request and one queued at most; then SIGTERM."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import time

import pytest

from serve.helpers import MODEL_NAME, get, metric, request, serve

KEY = "s3cret"


@pytest.fixture(scope="module")
def strict(model_folder, tmp_path_factory):
    folder = tmp_path_factory.mktemp("no_template")
    for f in model_folder.iterdir():
        shutil.copy(f, folder / f.name)
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))  # no chat template
    with serve(folder, "--api-key", KEY, "--max-num-seqs", "1", "--max-queue", "1", "--num-blocks", "64") as s:
        yield s


@pytest.fixture(scope="module")
def client(strict):
    from openai import OpenAI

    return OpenAI(base_url=strict.api, api_key=KEY, timeout=60, max_retries=0)


def test_api_key(strict, client):
    import openai

    with pytest.raises(openai.AuthenticationError) as err:
        openai.OpenAI(base_url=strict.api, api_key="wrong", max_retries=0).models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "invalid_api_key"
    status, _, raw = request("POST", strict.api + "/completions", b'{"model": "tiny", "prompt": "hello"}')  # no key
    assert status == 401 and json.loads(raw)["error"]["code"] == "invalid_api_key"
    assert get(strict.base + "/health")[0] == 200 and get(strict.base + "/metrics")[0] == 200  # open, as in vLLM
    assert client.models.list().data[0].id == MODEL_NAME


def test_chat_without_a_template_is_a_clear_400(client):
    import openai

    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=2)
    assert err.value.body["code"] == "no_chat_template" and "chat template" in err.value.body["message"]
    assert client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2).choices[0].finish_reason


def test_full_queue_is_503_with_retry_after(strict, client):
    """One request runs, one waits; a third is refused at once with Retry-After, and the first two complete."""
    long = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 250, "temperature": 0}
    running = client.completions.create(**long, stream=True)  # returns once admitted (headers sent)
    queued = client.completions.create(**long, stream=True)
    body = json.dumps({**long, "max_tokens": 2}).encode()
    status, headers, raw = request(
        "POST", strict.api + "/completions", body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert status == 503, raw
    assert {k.lower(): v for k, v in headers.items()}["retry-after"] == "1"
    assert json.loads(raw)["error"]["code"] == "server_busy"
    texts = ["".join(c.choices[0].text for c in s if c.choices) for s in (running, queued)]
    assert texts[0] == texts[1] and texts[0]  # the queued one ran after, the same greedy text
    # still served after the refusal: greedy, so its tokens begin the same text (sampled, a random-weight model
    # may draw its end-of-text token first and answer ''; a character cut after 2 bytes is replaced)
    after = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2, temperature=0).choices[0]
    assert after.finish_reason in ("length", "stop") and texts[0].startswith(after.text.rstrip("\ufffd")), (
        after,
        texts[0],
    )
    assert metric(strict.base, "ortpa_requests_waiting") == 0 and get(strict.base + "/health")[0] == 200


def test_sigterm_drains_and_exits(strict, client):
    stream = client.completions.create(model=MODEL_NAME, prompt="hello", max_tokens=200, temperature=0, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    t0 = time.monotonic()
    strict.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)  # the in-flight stream ends properly: a finish reason, then [DONE]
    reasons = [c.choices[0].finish_reason for c in [first, *rest] if c.choices and c.choices[0].finish_reason]
    assert reasons in (["length"], ["abort"]), reasons
    try:
        code = strict.proc.wait(15)
    except subprocess.TimeoutExpired:
        pytest.fail(f"ortpa serve still running 15 s after SIGTERM:\n{strict.output()}")
    assert code == 0, strict.output()
    assert time.monotonic() - t0 < 15
    with pytest.raises(OSError):
        get(strict.base + "/health", timeout=2)  # no longer accepting
