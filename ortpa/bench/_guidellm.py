"""guidellm (the ``load`` extra) as the load client of ``ortpa serve``: one run sweeps request rates or
concurrencies against an OpenAI endpoint, offline, with the served folder's own tokenizer, and its JSON report is
read back into one :class:`LoadLevel` per rate.

guidellm was chosen over aiperf because it installs with about twenty small packages (aiperf brings pandas,
matplotlib, plotly, dash, optuna and kubernetes clients) and runs against a local endpoint with a local
``tokenizer.json`` and synthetic prompts: nothing is downloaded. Its worker processes are limited to one and started
by ``forkserver``: on a small machine the default ten spawned workers cost a minute per level before the first
request (measured on 2 busy cores: 60 s per level with ten, 20 s with one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LoadLevel", "run_guidellm"]


@dataclass(frozen=True)
class LoadLevel:
    """One rate (or concurrency) of a guidellm run, as its report gives it."""

    label: str  # "constant@4" or "concurrent@8"
    successful: int
    errored: int
    incomplete: int
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float


def run_guidellm(
    api_base: str,
    model: str,
    tokenizer_folder: Path,
    report: Path,
    *,
    profile: str,
    values: list[float],
    requests_per_level: int,
    prompt_tokens: int = 32,
    output_tokens: int = 16,
    timeout_s: float = 900,
) -> list[LoadLevel]:
    """Run guidellm against ``api_base`` (``http://host:port``, no ``/v1``) once for every value of ``values``
    (``profile`` "constant": requests per second; "concurrent": streams), write its JSON report to ``report``
    and return the levels. Raises ``RuntimeError`` with guidellm's output if it fails."""
    key = {"constant": "rate", "concurrent": "streams"}[profile]
    first = values[0] if profile == "constant" else int(values[0])
    cmd = [sys.executable, "-m", "guidellm", "run"]
    cmd += ["--backend", f"kind=openai_http,target={api_base},model={model}"]
    cmd += ["--profile", f"kind={profile},{key}={first}"]
    if len(values) > 1:
        shown = [str(v if profile == "constant" else int(v)) for v in values]
        cmd += ["--override", f"profile.{key}", ",".join(shown)]
    cmd += ["--constraint", f"kind=max_requests,count={requests_per_level}"]
    cmd += ["--data", f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}"]
    cmd += ["--tokenizer", f"kind=huggingface_auto,model={tokenizer_folder}"]
    cmd += ["--output", f"kind=json,path={report}", "--disable-console-interactive"]
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "GUIDELLM__MAX_WORKER_PROCESSES": "1",
        "GUIDELLM__MP_CONTEXT_TYPE": "forkserver",
        # every level waits this long for its worker before the first request (default 1 s): one local worker
        # is ready sooner, and a short test sweep would spend most of its time waiting
        "GUIDELLM__SCHEDULER_START_DELAY_NON_DISTRIBUTED": "0.2",
    }
    # run in the report's folder: guidellm reads a `.env` from its working directory and writes defaults there
    done = subprocess.run(cmd, env=env, cwd=report.parent, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0 or not report.is_file():
        raise RuntimeError(f"guidellm exited with {done.returncode}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return read_report(report)


def read_report(report: Path) -> list[LoadLevel]:
    levels = []
    for bench in json.loads(report.read_text())["benchmarks"]:
        strategy = bench["config"]["strategy"]
        value = strategy.get("rate", strategy.get("streams"))
        m = bench["metrics"]
        totals = m["request_totals"]

        def pct(name: str, q: str, m=m) -> float:
            return float(m[name]["successful"]["percentiles"][q])

        levels.append(
            LoadLevel(
                label=f"{strategy['type_']}@{value:g}",
                successful=int(totals["successful"]),
                errored=int(totals["errored"]),
                incomplete=int(totals["incomplete"]),
                requests_per_s=float(m["requests_per_second"]["successful"]["mean"]),
                output_tokens_per_s=float(m["output_tokens_per_second"]["successful"]["mean"]),
                ttft_p50_ms=pct("time_to_first_token_ms", "p50"),
                ttft_p99_ms=pct("time_to_first_token_ms", "p99"),
                itl_p50_ms=pct("inter_token_latency_ms", "p50"),
                itl_p99_ms=pct("inter_token_latency_ms", "p99"),
            )
        )
    return levels
