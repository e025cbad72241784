"""guidellm, unmodified, against a live ``ortpa serve``: three request rates, not one request failed.

A short sweep (6 requests of 8 tokens per rate): what it checks is that a load tool's streamed requests, timings
and usage all come back whole at rising rates, not the figures (``ortpa bench --only serve`` measures those). Its
JSON report is kept in ``$ORTPA_TEST_ARTIFACTS`` when set (CI's artifacts folder), else in the test's temporary
folder, and its path is printed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ortpa.bench._guidellm import run_guidellm
from serve.helpers import MODEL_NAME, get

RATES = [4.0, 8.0, 16.0]
REQUESTS = 6
OUTPUT_TOKENS = 8


def _finished(base: str) -> dict[str, float]:
    """The server's counters of finished and refused requests, by label: ``{'finished length': 12.0, ...}``."""
    out = {}
    for line in get(base + "/metrics")[1].decode().splitlines():
        for name, label in (
            ("ortpa_requests_finished_total", "finish_reason"),
            ("ortpa_requests_rejected_total", "status"),
        ):
            if line.startswith(name + "{"):
                value = line.split(f'{label}="')[1].split('"')[0]
                out[f"{name.split('_')[2]} {value}"] = float(line.split()[-1])
    return out


def test_guidellm_sweeps_three_rates_without_a_failure(structured_server, structured_folder, tmp_path):
    where = Path(os.environ.get("ORTPA_TEST_ARTIFACTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    report = where / "guidellm-rates.json"
    before = _finished(structured_server.base)
    levels = run_guidellm(
        structured_server.base,
        MODEL_NAME,
        structured_folder,
        report,
        profile="constant",
        values=RATES,
        requests_per_level=REQUESTS,
        prompt_tokens=16,
        output_tokens=OUTPUT_TOKENS,
        timeout_s=300,
    )
    after = _finished(structured_server.base)
    print(f"guidellm report: {report}")
    assert [level.label for level in levels] == [f"constant@{r:g}" for r in RATES]
    benches = json.loads(report.read_text())["benchmarks"]  # the kept report, read back
    for level, bench in zip(levels, benches, strict=True):
        state = bench["scheduler_state"]
        assert (level.errored, level.incomplete, state["cancelled_requests"]) == (0, 0, 0), (level, state)
        # guidellm may close a level while its last request is still in flight (then counted in none of its
        # totals): every request it made either succeeded or was that one
        assert state["created_requests"] == REQUESTS, state
        assert level.successful + state["processing_requests"] == REQUESTS and level.successful >= REQUESTS - 1
        assert level.output_tokens_per_s > 0 and 0 < level.ttft_p50_ms <= level.ttft_p99_ms, level
        # every request got the tokens it asked for (guidellm sends ignore_eos)
        tokens = bench["metrics"]["output_token_count"]["successful"]
        assert tokens["min"] == tokens["max"] == OUTPUT_TOKENS, tokens
    # the rates were offered: a higher rate completes more requests per second
    assert levels[-1].requests_per_s > levels[0].requests_per_s, levels
    # and the server refused nothing and finished every request it was sent at its length
    new = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
    assert set(new) == {"finished length"} and new["finished length"] >= sum(lv.successful for lv in levels), new
