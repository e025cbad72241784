"""The limits a deployment sets (docs/serve.md, 'Limits'): each refused with its status and JSON error, at the
configured value and at the default, on a server started with small limits and two API keys."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from ortpa.bench._serve_hostile import Hostile, post
from ortpa.serve.limits import ServeLimits
from serve.helpers import MODEL_NAME, get, request, serve

KEYS = ("key-one", "key-two")
BODY = 100_000
PROMPT = 2_000


@pytest.fixture(scope="module")
def limited(model_folder):
    args = ["--num-blocks", "64", "--max-body-bytes", str(BODY), "--max-prompt-bytes", str(PROMPT), "--max-n", "2"]
    args += ["--api-key", KEYS[0], "--api-key", KEYS[1], "--max-concurrent-per-key", "1"]
    with serve(model_folder, *args) as s:
        yield s


def _auth(key: str = KEYS[0]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _port(server) -> int:
    return int(server.base.rsplit(":", 1)[1])


def _rejected(server, status: int) -> float:
    _, text = get(server.base + "/metrics")
    for line in text.decode().splitlines():
        if line.startswith(f'ortpa_requests_rejected_total{{status="{status}"}} '):
            return float(line.split()[1])
    return 0.0


def _error(raw: bytes) -> dict:
    return json.loads(raw)["error"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_50mb_body_is_refused_within_half_a_second(limited, chunked):
    """Refused from its Content-Length before a byte is read, or (chunked, no length) once the limit is passed;
    the client sees the 413 while it is still sending, long before 50 MB are through."""
    before = _rejected(limited, 413)
    huge = Hostile("huge", "/v1/completions", size=50_000_000, chunked=chunked)
    answer = asyncio.run(post("127.0.0.1", _port(limited), huge, _auth()))
    assert answer.status == 413, answer
    err = answer.json()["error"]
    assert err["code"] == "request_too_large" and err["type"] == "invalid_request_error"
    assert str(BODY) in err["message"] and "--max-body-bytes" in err["message"]
    assert answer.seconds < 0.5 and answer.sent < 25_000_000, answer.seconds
    assert _rejected(limited, 413) == before + 1
    assert get(limited.base + "/health")[0] == 200


def test_body_limit_boundary_and_every_route(limited):
    small = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}).encode()
    exact = small + b" " * (BODY - len(small))  # JSON with trailing whitespace: exactly the limit
    status, _, raw = request("POST", limited.api + "/completions", exact, headers=_auth())
    assert status == 200, raw
    status, _, raw = request("POST", limited.api + "/completions", exact + b" ", headers=_auth())
    assert status == 413 and _error(raw)["code"] == "request_too_large"
    for path in ("/v1/chat/completions", "/tokenize", "/detokenize"):
        status, _, raw = request("POST", limited.base + path, exact + b" ", headers=_auth())
        assert status == 413 and _error(raw)["code"] == "request_too_large", path


def test_prompt_bytes_limit(limited):
    over = "w" * (PROMPT + 1)  # one unknown word: one token, so only the byte limit can refuse it
    cases = [
        ("/v1/completions", {"prompt": over}, "prompt"),
        ("/v1/completions", {"prompt": ["w" * 1000, "w" * 1001]}, "prompt"),  # prompts of a request add up
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": over}]}, "messages"),
    ]
    for path, fields, param in cases:
        body = json.dumps({"model": MODEL_NAME, "max_tokens": 1, **fields}).encode()
        status, _, raw = request("POST", limited.base + path, body, headers=_auth())
        err = _error(raw)
        assert status == 400 and err["code"] == "prompt_too_long" and err["param"] == param, (path, raw)
        assert str(PROMPT) in err["message"] and "--max-prompt-bytes" in err["message"]
    body = json.dumps({"model": MODEL_NAME, "prompt": over}).encode()
    status, _, raw = request("POST", limited.base + "/tokenize", body, headers=_auth())
    assert status == 400 and _error(raw)["code"] == "prompt_too_long"
    fits = json.dumps({"model": MODEL_NAME, "prompt": "w" * PROMPT, "max_tokens": 1}).encode()
    assert request("POST", limited.api + "/completions", fits, headers=_auth())[0] == 200


def test_n_limit(limited):
    base = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}
    status, _, raw = request(
        "POST", limited.api + "/completions", json.dumps({**base, "n": 3}).encode(), headers=_auth()
    )
    err = _error(raw)
    assert status == 400 and err["param"] == "n" and "1 to 2" in err["message"] and "--max-n" in err["message"]
    status, _, raw = request(
        "POST", limited.api + "/completions", json.dumps({**base, "n": 2}).encode(), headers=_auth()
    )
    assert status == 200 and len(json.loads(raw)["choices"]) == 2


async def _hold(port: int, key: str):
    """A request that holds its key's slot: headers and half of its body sent, the rest held back."""
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    writer.write(head.encode() + body[:10])
    await writer.drain()
    return reader, writer, body[10:]


def test_concurrent_requests_per_key(limited):
    """Key one at its limit (1 in flight): its next request is a 429 at once; key two is not affected; a wrong
    key is still a 401; once key one's request has finished, key one is served again."""
    port = _port(limited)
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1}).encode()

    async def scenario():
        reader, writer, rest = await _hold(port, KEYS[0])
        await asyncio.sleep(0.2)  # the held request has reached the server
        loop = asyncio.get_running_loop()
        send = lambda key: loop.run_in_executor(  # noqa: E731
            None, lambda: request("POST", limited.api + "/completions", body, 10, _auth(key))
        )
        start = time.perf_counter()
        busy = await send(KEYS[0])
        busy_s = time.perf_counter() - start
        other = await send(KEYS[1])
        wrong = await send("not-a-key")
        writer.write(rest)  # the held request completes
        await writer.drain()
        held = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        await asyncio.sleep(0.1)
        again = await send(KEYS[0])
        return busy, busy_s, other, wrong, held, again

    before = _rejected(limited, 429)
    busy, busy_s, other, wrong, held, again = asyncio.run(scenario())
    status, headers, raw = busy
    err = _error(raw)
    assert status == 429 and err["code"] == "rate_limit_exceeded" and err["type"] == "requests", raw
    assert "--max-concurrent-per-key" in err["message"] and headers.get("retry-after") == "1"
    assert busy_s < 0.5
    assert other[0] == 200 and wrong[0] == 401 and b" 200 " in held.split(b"\r\n")[0] and again[0] == 200
    assert _rejected(limited, 429) == before + 1


def test_defaults(server):
    """The main server runs with the defaults: for its 256-token context, bodies of 256 KiB (the floor), 16 bytes
    of prompt per token (4096), 16 choices."""
    defaults = ServeLimits()
    assert defaults.body_bytes(256) == 256 << 10
    answer = asyncio.run(post("127.0.0.1", _port(server), Hostile("big", "/v1/completions", size=(256 << 10) + 1)))
    assert answer.status == 413 and str(256 << 10) in answer.json()["error"]["message"]
    body = json.dumps({"model": MODEL_NAME, "prompt": "w" * 4097, "max_tokens": 1}).encode()
    status, _, raw = request("POST", server.api + "/completions", body)
    assert status == 400 and _error(raw)["code"] == "prompt_too_long" and "4096" in _error(raw)["message"]
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 1, "n": defaults.max_n + 1}).encode()
    status, _, raw = request("POST", server.api + "/completions", body)
    assert status == 400 and _error(raw)["param"] == "n" and f"1 to {defaults.max_n}" in _error(raw)["message"]
