"""``ortpa serve`` under load: Poisson arrivals at concurrency 1, 8 and 32, driven by the official ``openai``
client, reporting what vLLM's ``benchmark_serving`` reports: request and output-token throughput, time to first
token (TTFT) and inter-token latency (ITL) at p50 / p99.

Model: the toy paged LM of the engine benchmark (hidden 256, 4 layers, vocab 512, fp16 attention, portable
PagedAttention on CPU) with a word-level tokenizer (``w0`` ... ``w510``), served by a ``python -m ortpa serve``
subprocess on 127.0.0.1. Workload: prompts of 8..128 tokens, 8..48 new tokens each, greedy, streamed; requests
arrive as a Poisson process (``RATE`` per second) and at most ``concurrency`` are in flight (vLLM's
``--max-concurrency``). Client and server share this machine's cores, so absolute figures are for comparison
within one run: the throughput at 8 and 32 streams is reported as a ratio to the single-stream throughput.
Wall-clock times (a server is measured as its clients see it); the server runs one ONNX Runtime thread.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

from ortpa.bench import format_table
from ortpa.bench._serve_overhead import overhead_rows
from ortpa.bench._server import live_server
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

EXTRAS = ("serve", "test")  # the server, and the openai client that drives it

__all__ = ["run"]

CONFIG = ToyLMConfig(vocab=512, hidden=256, num_heads=4, kv_heads=2, num_layers=4, max_positions=512)
CONCURRENCY = (1, 8, 32)
RATE = 64.0  # requests per second offered; the concurrency cap is what binds
NAME = "toy"


def _write_folder(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    onnx.save(build_toy_lm(CONFIG), str(folder / "model.onnx"))
    words = [f"w{i}" for i in range(CONFIG.vocab - 1)] + ["[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": CONFIG.max_positions}))


def _workload(n: int, seed: int = 0) -> list[tuple[str, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = rng.integers(0, CONFIG.vocab - 1, size=int(rng.integers(8, 129)))
        out.append((" ".join(f"w{i}" for i in ids), int(rng.integers(8, 49))))
    return out


async def _level(api: str, work: list[tuple[str, int]], concurrency: int, seed: int) -> dict:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=api, api_key="bench", timeout=600, max_retries=0)
    limit = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    itl: list[float] = []
    tokens = 0

    async def one(prompt: str, max_tokens: int) -> None:
        nonlocal tokens
        async with limit:
            t0 = time.perf_counter()
            last = None
            stream = await client.completions.create(
                model=NAME,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens
                if not any(c.text for c in chunk.choices):
                    continue
                if last is None:
                    ttft.append(now - t0)
                else:
                    itl.append(now - last)
                last = now

    gaps = np.random.default_rng(seed).exponential(1.0 / RATE, size=len(work))
    t0 = time.perf_counter()
    tasks = []
    for (prompt, max_tokens), gap in zip(work, gaps, strict=True):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one(prompt, max_tokens)))
    await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    await client.close()
    return {"elapsed": elapsed, "requests": len(work), "tokens": tokens, "ttft": ttft, "itl": itl}


def run(quick: bool = False) -> list[dict]:
    n = 16 if quick else 64
    work = _workload(n)
    env = f"{os.cpu_count()} cpus shared by client and server, wall time"
    rows = []
    with tempfile.TemporaryDirectory(prefix="ortpa-bench-serve-") as tmp:
        folder = Path(tmp)
        _write_folder(folder)
        with live_server(folder, NAME) as url:
            api = url + "/v1"
            asyncio.run(_level(api, work[:4], 4, seed=99))  # warm-up: first-run allocations, connections
            results = {c: asyncio.run(_level(api, work, c, seed=c)) for c in CONCURRENCY}
            prompts = [p for p, _ in work[: 16 if quick else 32]]
            extras = overhead_rows(api, NAME, prompts, quick=quick, notes=f"toy LM vocab {CONFIG.vocab}; {env}")
    base = results[1]["tokens"] / results[1]["elapsed"]
    for c, r in results.items():
        name = f"serve c={c}"
        notes = f"{r['requests']} requests, Poisson {RATE:g}/s, toy LM vocab {CONFIG.vocab}; {env}"
        tps = r["tokens"] / r["elapsed"]
        rows += [
            {
                "name": name,
                "metric": "request throughput",
                "value": r["requests"] / r["elapsed"],
                "unit": "req/s",
                "notes": notes,
            },
            {"name": name, "metric": "output throughput", "value": tps, "unit": "tok/s", "notes": notes},
            {
                "name": name,
                "metric": "output throughput vs c=1",
                "value": tps / base,
                "unit": "x",
                "notes": "ratio, same run",
            },
        ]
        for label, values in (("TTFT", r["ttft"]), ("ITL", r["itl"])):
            for q in (50, 99):
                rows.append(
                    {
                        "name": name,
                        "metric": f"{label} p{q}",
                        "value": 1e3 * float(np.percentile(values, q)),
                        "unit": "ms",
                        "notes": "",
                    }
                )
    from ortpa.bench import _serve_extras  # structured-output overhead, guidellm's serving table
    from ortpa.bench._serve_hostile import soak_rows  # hostile requests beside streams (issue 41)

    return rows + extras + _serve_extras.run(quick) + soak_rows(quick)


if __name__ == "__main__":
    print(format_table(run(quick="--quick" in sys.argv)))
