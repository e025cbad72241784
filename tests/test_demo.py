"""``ortpa.demo.run_demo`` end to end in a temporary directory, and the parity judge it relies on."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from ortpa.demo import (
    DEMO_CONFIG,
    DEMO_NEW_TOKENS,
    DEMO_PROMPT_LENGTHS,
    PARITY_ATOL,
    PARITY_RTOL,
    DemoSummary,
    _parity,
    run_demo,
)
from ortpa.errors import InvalidParameter
from ortpa.parity.greedy import GreedyRun
from ortpa.tolerances import precision_logit_bound

PARITY_TOL = (PARITY_RTOL, PARITY_ATOL)


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> tuple[DemoSummary, list[str]]:
    messages: list[str] = []
    summary = run_demo(tmp_path_factory.mktemp("demo"), progress=messages.append)
    return summary, messages


def test_demo_is_ok_and_writes_both_models(demo):
    summary, _ = demo
    assert summary.ok, summary.format()
    assert summary.failures == []
    dense, paged = onnx.load(summary.dense_model), onnx.load(summary.paged_model)
    assert {i.name for i in dense.graph.input} >= {"input_ids", "attention_mask", "past_key_values.0.value"}
    assert sum(n.op_type == "PagedAttention" for n in paged.graph.node) == DEMO_CONFIG.layers
    assert summary.paged_attention_nodes == summary.layers == DEMO_CONFIG.layers
    assert summary.dense_model_bytes > 0 and summary.paged_model_bytes > 0
    assert summary.validation_ok and summary.validation_backend == "cuda"


def test_demo_parity_and_figures(demo):
    summary, _ = demo
    assert summary.tokens_identical and summary.token_mismatches == 0 and summary.near_ties == 0
    assert summary.engine_tokens_identical
    assert 0.0 < summary.max_abs_error < summary.tolerance[1]
    assert len(summary.max_abs_error_per_step) == DEMO_NEW_TOKENS
    assert summary.max_abs_error == max(summary.max_abs_error_per_step)
    assert [len(t) for t in summary.outputs] == [DEMO_NEW_TOKENS] * len(DEMO_PROMPT_LENGTHS)
    c = DEMO_CONFIG
    latent = c.kv_lora_rank + c.qk_rope
    assert summary.kv_bytes_per_token_dense == latent * 4  # the export's fp32 latent + k_pe
    assert summary.kv_bytes_per_token_paged == latent * 2  # one fp16 LATENT row
    assert summary.kv_bytes_per_token_mha == c.heads * (c.qk_nope + c.qk_rope + c.v_head) * 2
    assert summary.kv_bytes_per_token_paged_total == latent * 2 * c.layers
    assert summary.tokens_per_second > 0 and summary.dense_tokens_per_second > 0


def test_demo_reports(demo):
    summary, messages = demo
    assert [m for m in messages if "absorbing layer" in m] == [
        f"  convert: absorbing layer {i}" for i in range(DEMO_CONFIG.layers)
    ]
    assert messages[-1] == summary.format()
    text = summary.format()
    assert text.startswith("ortpa demo: OK") and summary.paged_model in text and "tok/s" in text
    data = json.loads(json.dumps(summary.to_dict()))
    assert data["ok"] is True and data["kv_bytes_per_token_paged_total"] == summary.kv_bytes_per_token_paged_total


def test_quiet_demo_leaves_the_summary_to_the_caller(tmp_path, capsys):
    calls: list[str] = []
    summary = run_demo(tmp_path, provider="cpu", quiet=True, progress=calls.append)
    assert summary.ok and summary.provider == "CPUExecutionProvider"
    assert calls and "absorbing layer 0" in "\n".join(calls) and summary.format() not in calls
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense_mla.onnx", "genai_config.json", "paged_mla.onnx"]
    run_demo(tmp_path / "again", quiet=True, progress=None)
    assert capsys.readouterr().out == ""


def test_unknown_provider_is_a_typed_error(tmp_path):
    with pytest.raises(InvalidParameter, match="expected an available provider"):
        run_demo(tmp_path, provider="NoSuchExecutionProvider", quiet=True)


def _run(tokens: list[list[int]], logits: list[np.ndarray]) -> GreedyRun:
    return GreedyRun(tokens, logits, seconds=1.0, runs=len(tokens[0]))


def test_parity_judge_fails_on_errors_and_allows_only_near_ties():
    dense = np.array([[0.0, 3.0, 1.0], [2.0, 2.001, 0.0]], np.float32)  # step 1 is a near tie
    ref = _run([[1, 1]], [dense])
    per_step, mismatches, ties, gap, failures = _parity(_run([[1, 0]], [dense + 1e-4]), ref)
    assert (mismatches, ties, failures) == (0, 1, []) and gap == pytest.approx(0.001, abs=1e-6)
    assert per_step == [pytest.approx(1e-4, rel=1e-2)] * 2
    _, mismatches, _, _, failures = _parity(_run([[2, 1]], [dense]), ref)  # step 0: a clear winner, wrong token
    assert mismatches == 1 and "paged token 2, dense 1" in failures[0]
    far = dense.copy()
    far[0, 1] += 0.5  # the next-token distribution moves by KL ~1.6e-2, past the float16 bound (9.8e-4)
    _, _, _, _, failures = _parity(_run([[1, 1]], [far]), ref)
    assert failures and "next-token KL" in failures[0]
    near = dense.copy()
    near[0, 1] += 0.02  # within float16's precision: KL ~3e-5
    assert _parity(_run([[1, 1]], [near]), ref)[4] == []


def test_parity_judge_bounds_the_number_of_near_ties():
    """One near tie in a short run is allowed (ortpa.tolerances.max_tie_flips), two are not."""
    dense = np.array([[2.0, 2.001, 0.0], [2.0, 2.001, 0.0]], np.float32)  # both steps are near ties
    ref = _run([[1, 1]], [dense])
    _, mismatches, ties, _, failures = _parity(_run([[0, 0]], [dense]), ref)
    assert (mismatches, ties) == (0, 2) and len(failures) == 1 and "2 near ties in 2 tokens" in failures[0]


def test_demo_tolerance_is_the_package_rule():
    assert PARITY_TOL == (0.0, precision_logit_bound("float16"))
