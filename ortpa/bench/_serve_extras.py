"""The rows ``ortpa bench --only serve`` adds to its openai-client table: the per-token overhead of structured
output as a ratio to plain decoding in the same run, and the serving table with guidellm (the ``load`` extra) as
the client.

Model: the serve benchmark's toy paged LM (hidden 256, 4 layers, vocab 512, portable PagedAttention on CPU) with
a byte-level BPE tokenizer (``ortpa.testing.byte_tokenizer``: a word-level one cannot spell JSON), served by a
``python -m ortpa serve`` subprocess on 127.0.0.1 with one ONNX Runtime thread.

Structured output: the same streamed chat requests (seeded sampling, temperature 1, 48 tokens) plain, with a
``json_schema`` response format and with a ``guided_regex``, at 1 and 8 requests in flight. The grammars cannot
complete within 48 tokens (a string of at least 200 characters), and plain requests send ``ignore_eos``, so every
request of every mode produces exactly 48 tokens and the modes differ only in the masks. The figure is the wall time
per generated token (the requests' total time over their tokens; the time between streamed chunks would not do, as
the server merges the tokens a slow reader has not taken yet), structured over plain; and the same ratio for the
engine alone (``Engine.generate``, no HTTP). Modes are interleaved and the best of the rounds kept.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import onnx

from ortpa.bench._server import live_server
from ortpa.testing.byte_tokenizer import write_byte_tokenizer
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

__all__ = ["run"]

CONFIG = ToyLMConfig(vocab=512, hidden=256, num_heads=4, kv_heads=2, num_layers=4, max_positions=512)
NAME = "toy"
TOKENS = 48
SCHEMA = {
    "type": "object",
    "properties": {
        "summary": {"type": "string", "minLength": 200, "maxLength": 400},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["summary", "score"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{4,12}@[a-z]{3,8}\.(com|org|net)( [a-z0-9]{2,8}){40,80}"
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


async def _wall_per_token(api: str, mode: str, requests: int, concurrency: int) -> tuple[float, int]:
    """Wall time per generated token (s) over ``requests`` streamed requests of ``mode``, and the token count."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=api, api_key="bench", timeout=600, max_retries=0)
    limit = asyncio.Semaphore(concurrency)
    tokens = 0

    async def one(seed: int) -> None:
        nonlocal tokens
        async with limit:
            stream = await client.chat.completions.create(
                model=NAME,
                messages=[{"role": "user", "content": f"record {seed}: name, age, tags"}],
                max_tokens=TOKENS,
                temperature=1.0,
                seed=seed,
                stream=True,
                stream_options={"include_usage": True},
                **MODES[mode],
            )
            async for chunk in stream:
                if chunk.usage is not None:
                    tokens += chunk.usage.completion_tokens

    start = time.perf_counter()
    try:
        await asyncio.gather(*(one(i) for i in range(requests)))
    finally:
        await client.close()
    return (time.perf_counter() - start) / max(tokens, 1), tokens


def _engine_rows(folder: Path, quick: bool) -> list[dict]:
    """Per-token time of ``Engine.generate`` with every request constrained, over the same without constraints."""
    import llguidance as llg
    import onnxruntime as ort
    from tokenizers import Tokenizer

    from ortpa.runtime.engine import Engine, SamplingParams
    from ortpa.serve.structured import Grammars, GuidedGrammar, json_grammar

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    grammars = Grammars(tokenizer, [1])
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # as the server runs (--threads 1)
    engine = Engine(folder / "model.onnx", num_blocks=2048, max_num_seqs=64, sess_options=options)
    prompts = [tokenizer.encode(f"record {i}: name, age, tags").ids for i in range(8)]
    grammar = {
        "json_schema": json_grammar(SCHEMA, "schema"),
        "regex": GuidedGrammar(llg.LLMatcher.grammar_from_regex(REGEX), "regex"),
    }

    def per_token(mode: str) -> float:
        params = [
            SamplingParams(
                max_new_tokens=TOKENS,
                temperature=1.0,
                seed=i,
                constraint=None if mode == "plain" else grammars.constraint(grammar[mode]),
            )
            for i in range(len(prompts))
        ]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
        return elapsed / sum(len(o) for o in outputs)

    per_token("json_schema")  # warm-up: session, grammar tables
    # modes interleaved, best of the rounds: a busy machine's drift falls on every mode alike
    samples: dict[str, list[float]] = {"plain": [], "json_schema": [], "regex": []}
    for _ in range(2 if quick else 5):
        for mode, values in samples.items():
            values.append(per_token(mode))
    times = {mode: min(values) for mode, values in samples.items()}
    notes = f"Engine.generate, {len(prompts)} requests x {TOKENS} tokens, one process; toy LM, byte BPE 512"
    name = "engine structured c=8"
    rows = [
        {
            "name": name,
            "metric": f"per-token time {m}",
            "value": 1e3 * t,
            "unit": "ms",
            "notes": notes,
        }
        for m, t in times.items()
    ]
    rows += [
        {
            "name": name,
            "metric": f"{m} per-token time vs plain",
            "value": times[m] / times["plain"],
            "unit": "x",
            "notes": "ratio, same run",
        }
        for m in ("json_schema", "regex")
    ]
    return rows


def _structured_rows(api: str, quick: bool) -> list[dict]:
    requests = 8 if quick else 32
    asyncio.run(_wall_per_token(api, "json_schema", 2, 2))  # warm-up: grammar tables, connections
    rows = []
    for concurrency in (1, 8):
        samples: dict[str, list[float]] = {mode: [] for mode in MODES}
        counts: dict[str, int] = {}
        for _ in range(1 if quick else 2):  # modes interleaved, best of the rounds
            for mode in MODES:
                per_token, counts[mode] = asyncio.run(_wall_per_token(api, mode, requests, concurrency))
                samples[mode].append(per_token)
        best = {mode: min(values) for mode, values in samples.items()}
        name = f"serve structured c={concurrency}"
        for mode, value in best.items():
            notes = f"{requests} streamed chat requests, {counts[mode]} tokens, seeded sampling; toy LM, byte BPE 512"
            rows.append(
                {"name": name, "metric": f"wall per token {mode}", "value": 1e3 * value, "unit": "ms", "notes": notes}
            )
            if mode != "plain":
                rows.append(
                    {
                        "name": name,
                        "metric": f"{mode} per-token time vs plain",
                        "value": value / best["plain"],
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
        rows = _engine_rows(folder, quick)
        with live_server(folder, NAME) as base:
            return rows + _structured_rows(base + "/v1", quick) + _load_rows(base, folder, quick)


if __name__ == "__main__":
    from ortpa.bench import format_table

    print(format_table(run(quick="--quick" in sys.argv)))
