"""The parity verdict: two greedy runs' logits and tokens, compared step by step within the tolerance table.

:func:`compare_runs` is what ``ortpa parity`` prints and what any other caller (the conversion's own check,
tests) asks: the worst logit error per step, how many sequences agree at each step, and whether the converted
run stayed within ``atol + rtol * |original|`` with the original's greedy tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ortpa.parity.greedy import GreedyRun
from ortpa.tolerances import TieBound, max_tie_flips

__all__ = ["ParityResult", "StepReport", "compare_runs", "default_prompts"]


@dataclass(frozen=True)
class StepReport:
    """One greedy step over every sequence still running at it."""

    step: int
    max_abs_logit_error: float
    tokens_agree: int
    min_top_gap: float = 0.0  # the original's smallest top-1 / top-2 logit gap over the sequences at this step
    ties: int = 0  # flips where that gap is within the tie margin (ortpa.tolerances.TieBound)
    mismatches: int = 0  # flips outside it


@dataclass
class ParityResult:
    """``ok``: every compared logit within the bound and every sequence's tokens equal to the original's."""

    ok: bool
    max_abs_logit_error: float
    tokens_identical: bool
    prompts: int
    atol: float
    rtol: float
    steps: list[StepReport] = field(default_factory=list)
    ties: int = 0
    mismatches: int = 0
    max_ties: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [
            f"step {s.step:3d}  max |dlogit| {s.max_abs_logit_error:.3e}  tokens agree {s.tokens_agree}/{self.prompts}"
            f"  top-1/top-2 gap {s.min_top_gap:.3e}"
            + (f"  ties {s.ties}" if s.ties else "")
            + (f"  MISMATCHES {s.mismatches}" if s.mismatches else "")
            for s in self.steps
        ]
        lines.append(
            ("PARITY OK" if self.ok else "PARITY FAILED")
            + f": max |dlogit| {self.max_abs_logit_error:.3e} (atol {self.atol:g} + rtol {self.rtol:g} * |dense|), "
            f"greedy tokens {'identical' if self.tokens_identical else 'differ'}"
            + (f" ({self.ties} tie(s) within the margin, at most {self.max_ties} allowed)" if self.ties else "")
            + (f"; {self.mismatches} real mismatch(es)" if self.mismatches else "")
        )
        return "\n".join(lines)


def compare_runs(original: GreedyRun, converted: GreedyRun, *, rtol: float, atol: float) -> ParityResult:
    """``converted`` against ``original`` (same prompts, same number of steps), logits in float32.

    Run ``converted`` following the original's tokens (``paged_greedy(..., follow=original.tokens)``) so that
    both see the same inputs at every step: a flip is then judged at its own step and does not cascade. A flip
    where the original's top-1 / top-2 gap is within :meth:`TieBound.margin` is a tie (at most
    :func:`ortpa.tolerances.max_tie_flips` of the checked tokens); any other flip, or a logit outside
    ``atol + rtol * |original|``, fails.
    """
    if len(original.tokens) != len(converted.tokens):
        raise ValueError(
            f"parity: expected runs over the same prompts, got {len(original.tokens)} and {len(converted.tokens)}"
        )
    bound = TieBound(rtol, atol)
    n_steps = max((len(t) for t in original.tokens), default=0)
    steps, within, checked = [], True, 0
    for step in range(n_steps):
        errs, gaps, agree, ties, mismatches = [], [], 0, 0, 0
        for g_rows, r_rows, g_tok, r_tok in zip(
            converted.logits, original.logits, converted.tokens, original.tokens, strict=True
        ):
            if step >= min(len(g_rows), len(r_rows), len(g_tok), len(r_tok)):
                continue
            g, r = g_rows[step], r_rows[step]
            errs.append(float(np.abs(g - r).max()))
            within = within and bool((np.abs(g - r) <= atol + rtol * np.abs(r)).all())
            top2 = np.sort(np.asarray(r, np.float32))[-2:]
            gaps.append(float(top2[-1] - top2[0]) if top2.size == 2 else float("inf"))
            checked += 1
            verdict = bound.classify(r, int(g_tok[step]))
            agree += g_tok[step] == r_tok[step]
            ties += verdict == "tie"
            mismatches += verdict == "mismatch"
        steps.append(StepReport(step, max(errs) if errs else 0.0, agree, min(gaps) if gaps else 0.0, ties, mismatches))
    identical = all(g == r for g, r in zip(converted.tokens, original.tokens, strict=True))
    worst = max((s.max_abs_logit_error for s in steps), default=0.0)
    ties, mismatches = sum(s.ties for s in steps), sum(s.mismatches for s in steps)
    allowed = max_tie_flips(checked)
    ok = within and mismatches == 0 and ties <= allowed
    return ParityResult(ok, worst, identical, len(original.tokens), atol, rtol, steps, ties, mismatches, allowed)


def default_prompts(thresholds: list[int] | tuple[int, ...]) -> list[list[int]]:
    """Three short prompts, and one longer than every length threshold of the original (LongRoPE's original
    length, a sliding window), so that parity also covers the branch a short prompt never reaches."""
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    if thresholds:
        prompts.append([11 + i % 64 for i in range(max(thresholds) + 8)])
    return prompts
