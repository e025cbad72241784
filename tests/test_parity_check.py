"""``compare_runs`` tells ties from bugs: a flip within the tie margin passes (counted), a real one fails."""

from __future__ import annotations

import numpy as np

from ortpa.parity.check import compare_runs
from ortpa.parity.greedy import GreedyRun
from ortpa.tolerances import TOL

RTOL, ATOL = TOL["float16"]


def _run(rows: list[np.ndarray]) -> GreedyRun:
    logits = np.stack(rows).astype(np.float32)
    return GreedyRun([[int(r.argmax()) for r in logits]], [logits], 0.0, len(rows))


def _rows(n_steps: int = 4, vocab: int = 16, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(vocab).astype(np.float32) * 3 for _ in range(n_steps)]


def test_identical_runs_pass_and_report_gaps():
    rows = _rows()
    result = compare_runs(_run(rows), _run(rows), rtol=RTOL, atol=ATOL)
    assert result.ok and result.ties == 0 and result.mismatches == 0
    gaps = [float(np.sort(r)[-1] - np.sort(r)[-2]) for r in rows]
    assert [s.min_top_gap for s in result.steps] == gaps


def test_a_flip_within_the_margin_is_a_tie():
    rows = _rows()
    top = int(rows[2].argmax())
    rows[2][(top + 1) % 16] = rows[2][top] - ATOL  # the original's top two 5e-3 apart
    other = [r.copy() for r in rows]
    other[2][(top + 1) % 16] += 1.5 * ATOL  # within atol of the original, yet the other token wins
    result = compare_runs(_run(rows), _run(other), rtol=RTOL, atol=ATOL)
    assert result.ok, result.format()
    assert result.ties == 1 and result.steps[2].ties == 1 and not result.tokens_identical
    assert "tie" in result.format()


def test_a_real_difference_fails():
    rows = _rows()
    other = [r.copy() for r in rows]
    top = int(rows[1].argmax())
    other[1][(top + 1) % 16] = rows[1][top] + 1.0
    result = compare_runs(_run(rows), _run(other), rtol=RTOL, atol=ATOL)
    assert not result.ok and result.mismatches == 1
    assert "PARITY FAILED" in result.format() and "mismatch" in result.format()
