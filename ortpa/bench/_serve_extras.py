"""The rows ``ortpa bench --only serve`` adds to its openai-client table: the per-token overhead of structured
output as a ratio to plain decoding in the same run, and the serving table with guidellm (the ``load`` extra) as
the client.

Model: the serve benchmark's toy paged LM (hidden 256, 4 layers, vocab 512, portable PagedAttention on CPU) with
a byte-level BPE tokenizer (``ortpa.testing.byte_tokenizer``: a word-level one cannot spell JSON), served by a
``python -m ortpa serve`` subprocess on 127.0.0.1 with one ONNX Runtime thread.

Structured output: the same streamed chat requests (seeded sampling, temperature 1) plain, with a ``json_schema``
response format and with a ``guided_regex``, at 1 and 8 requests in flight. The figure is the mean time between
streamed tokens (ITL: the step time a client sees, prefill excluded), structured over plain. Plain requests send
``ignore_eos`` so their lengths are fixed; structured ones end where the grammar does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx

from ortpa.testing.byte_tokenizer import write_byte_tokenizer
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

__all__ = ["run"]

CONFIG = ToyLMConfig(vocab=512, hidden=256, num_heads=4, kv_heads=2, num_layers=4, max_positions=512)
NAME = "toy"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{4,12}@[a-z]{3,8}\.(com|org|net)( [a-z]{2,8}){1,4}"
MODES = {
    "plain": {"extra_body": {"ignore_eos": True}},
    "json_schema": {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
    "regex": {"extra_body": {"guided_regex": REGEX}},
}


def _write_folder(folder: Path) -> None:
    onnx.save(build_toy_lm(CONFIG), str(folder / "model.onnx"))
    write_byte_tokenizer(folder / "tokenizer.json", CONFIG.vocab)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "chat_template": template}))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": CONFIG.max_positions}))


@contextlib.contextmanager
def _server(folder: Path) -> Iterator[str]:
    with contextlib.closing(socket.socket()) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "ortpa", "serve", str(folder), "--port", str(port), "--served-model-name", NAME]
    cmd += ["--num-blocks", "2048", "--max-num-seqs", "64", "--threads", "1", "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ortpa serve exited: {proc.stderr.read().decode(errors='replace')}")
            with contextlib.suppress(OSError), urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("ortpa serve did not become healthy in 120 s")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def _itl(api: str, mode: str, requests: int, concurrency: int) -> tuple[float, int]:
    """Mean inter-token gap (s) over every streamed request of ``mode``, and the tokens they produced."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=api, api_key="bench", timeout=600, max_retries=0)
    limit = asyncio.Semaphore(concurrency)
    gaps: list[float] = []
    tokens = 0

    async def one(seed: int) -> None:
        nonlocal tokens
        async with limit:
            stream = await client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": f"record {seed}: name, age, tags"}],
                max_tokens=64,
                temperature=1.0,
                seed=seed,
                stream=True,
                stream_options={"include_usage": True},
                **MODES[mode],
            )
            last = None
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
                if not any(c.delta.content for c in chunk.choices):
                    continue
                if last is not None:
                    gaps.append(now - last)
                last = now

    try:
        await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        await client.close()
    return float(np.mean(gaps)), tokens


def _structured_rows(api: str, quick: bool) -> list[dict]:
    requests = 8 if quick else 32
    asyncio.run(_itl(api, "json_schema", 2, 2))  # warm-up: the grammar engine's tokenizer tables, connections
    asyncio.run(_itl(api, "plain", 2, 2))
    rows = []
    for concurrency in (1, 8):
        results = {mode: asyncio.run(_itl(api, mode, requests, concurrency)) for mode in MODES}
        plain = results["plain"][0]
        for mode, (itl, tokens) in results.items():
            notes = f"{requests} streamed chat requests, {tokens} tokens, seeded sampling; toy LM, byte BPE 512"
            name = f"serve structured c={concurrency}"
            rows.append({"name": name, "metric": f"ITL mean {mode}", "value": 1e3 * itl, "unit": "ms", "notes": notes})
            if mode != "plain":
                rows.append(
                    {
                        "name": name,
                        "metric": f"{mode} per-token time vs plain",
                        "value": itl / plain,
                        "unit": "x",
                        "notes": "ratio, same run",
                    }
                )
    return rows


def _load_rows(base: str, folder: Path, quick: bool) -> list[dict]:
    try:
        import guidellm  # noqa: F401
    except ImportError:
        note = "guidellm is not installed: pip install 'ortpa[load]'"
        return [{"name": "serve guidellm", "metric": "not run", "value": "", "unit": "", "notes": note}]
    from ortpa.bench._guidellm import run_guidellm

    per_level = 16 if quick else 64
    with tempfile.TemporaryDirectory(prefix="ortpa-bench-guidellm-") as tmp:
        levels = run_guidellm(
            base,
            NAME,
            folder,
            Path(tmp) / "report.json",
            profile="concurrent",
            values=[1, 8, 32],
            requests_per_level=per_level,
            prompt_tokens=64,
            output_tokens=32,
        )
    rows = []
    notes = f"guidellm, {per_level} requests per level, 64 + 32 tokens (ignore_eos); {os.cpu_count()} cpus"
    for level in levels:
        name = f"serve guidellm {level.label}"
        values = [
            ("request throughput", level.requests_per_s, "req/s"),
            ("output throughput", level.output_tokens_per_s, "tok/s"),
            ("TTFT p50", level.ttft_p50_ms, "ms"),
            ("TTFT p99", level.ttft_p99_ms, "ms"),
            ("ITL p50", level.itl_p50_ms, "ms"),
            ("ITL p99", level.itl_p99_ms, "ms"),
            ("failed requests", float(level.errored + level.incomplete), "requests"),
        ]
        rows += [{"name": name, "metric": m, "value": v, "unit": u, "notes": notes} for m, v, u in values]
    return rows


def run(quick: bool = False) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="ortpa-bench-serve-extras-") as tmp:
        folder = Path(tmp)
        _write_folder(folder)
        with _server(folder) as base:
            return _structured_rows(base + "/v1", quick) + _load_rows(base, folder, quick)


if __name__ == "__main__":
    from ortpa.bench import format_table

    print(format_table(run(quick="--quick" in sys.argv)))
