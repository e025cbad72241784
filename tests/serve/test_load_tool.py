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
from serve.helpers import MODEL_NAME

RATES = [4.0, 8.0, 16.0]
REQUESTS = 6
OUTPUT_TOKENS = 8


def test_guidellm_sweeps_three_rates_without_a_failure(structured_server, structured_folder, tmp_path):
    where = Path(os.environ.get("ORTPA_TEST_ARTIFACTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    report = where / "guidellm-rates.json"
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
    print(f"guidellm report: {report}")
    assert [level.label for level in levels] == [f"constant@{r:g}" for r in RATES]
    for level in levels:
        assert (level.successful, level.errored, level.incomplete) == (REQUESTS, 0, 0), level
        assert level.output_tokens_per_s > 0 and 0 < level.ttft_p50_ms <= level.ttft_p99_ms, level
    # the rates were offered: a higher rate completes more requests per second
    assert levels[-1].requests_per_s > levels[0].requests_per_s, levels
    # the kept report says every request got the tokens it asked for (guidellm sends ignore_eos)
    for bench in json.loads(report.read_text())["benchmarks"]:
        tokens = bench["metrics"]["output_token_count"]["successful"]
        assert tokens["min"] == tokens["max"] == OUTPUT_TOKENS, tokens
