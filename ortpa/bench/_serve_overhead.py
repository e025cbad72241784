"""Per-token cost of the sampling extras through a live ``ortpa serve``, as ratios to plain decoding in the same
run: ``logprobs`` (the chosen token and 5 alternatives per token), the penalties (presence, frequency and
repetition together, which count every request's tokens each step) and ``logit_bias``.

The same prompts (greedy, ``max_tokens`` fixed: the toy model has no EOS, so every request runs to its length)
are sent at concurrency 8, non-streamed. A round runs every variant once, back to back (the order rotating from
round to round); a variant's ratio is the median over ``ROUNDS`` rounds of its time over plain's in the same
round, so that load the machine's other work adds or removes between rounds cancels out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

__all__ = ["VARIANTS", "overhead_rows"]

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "logprobs": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "extra_body": {"repetition_penalty": 1.2}},
    "logit_bias": {"logit_bias": {str(i): -1.0 for i in range(0, 200, 2)}},
}
ROUNDS = 5
CONCURRENCY = 8


async def _round(api: str, name: str, prompts: list[str], max_tokens: int, extra: dict[str, Any]) -> float:
    """Seconds per generated token for one pass over ``prompts``."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=api, api_key="bench", timeout=600, max_retries=0)
    limit = asyncio.Semaphore(CONCURRENCY)
    tokens = 0

    async def one(prompt: str) -> None:
        nonlocal tokens
        async with limit:
            out = await client.completions.create(
                model=name, prompt=prompt, max_tokens=max_tokens, temperature=0, **extra
            )
            tokens += out.usage.completion_tokens

    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - t0
    await client.close()
    return elapsed / max(tokens, 1)


def overhead_rows(api: str, name: str, prompts: list[str], *, quick: bool, notes: str) -> list[dict[str, Any]]:
    max_tokens = 16 if quick else 32
    names = list(VARIANTS)
    times: dict[str, list[float]] = {v: [] for v in names}
    for r in range(2 if quick else ROUNDS):
        for variant in names[r % len(names) :] + names[: r % len(names)]:
            times[variant].append(asyncio.run(_round(api, name, prompts, max_tokens, VARIANTS[variant])))
    plain = np.array(times["plain"])
    rows = [
        {
            "name": "serve sampling extras",
            "metric": "per-token time, plain",
            "value": 1e3 * float(np.median(plain)),
            "unit": "ms",
            "notes": f"{len(prompts)} requests x {max_tokens} tokens at concurrency {CONCURRENCY}; {notes}",
        }
    ]
    for variant in names[1:]:
        ratios = np.array(times[variant]) / plain
        rows.append(
            {
                "name": "serve sampling extras",
                "metric": f"per-token time, {variant} / plain",
                "value": float(np.median(ratios)),
                "unit": "x",
                "notes": f"median of {len(ratios)} same-round ratios (range {ratios.min():.2f}-{ratios.max():.2f})",
            }
        )
    return rows
