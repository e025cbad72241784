"""The parity verdict: two greedy runs' logits and tokens, compared step by step within the tolerance table.

:func:`compare_runs` is what ``ortpa parity`` prints and what any other caller (the conversion's own check,
tests) asks: the worst logit error per step, how many sequences agree at each step, and whether the converted
run stayed within ``atol + rtol * |original|`` with the original's greedy tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ortpa.parity.greedy import GreedyRun

__all__ = ["ParityResult", "StepReport", "compare_runs", "default_prompts"]


@dataclass(frozen=True)
class StepReport:
    """One greedy step over every sequence still running at it."""

    step: int
    max_abs_logit_error: float
    tokens_agree: int


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

    def to_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        lines = [
            f"step {s.step:3d}  max |dlogit| {s.max_abs_logit_error:.3e}  tokens agree {s.tokens_agree}/{self.prompts}"
            for s in self.steps
        ]
        lines.append(
            ("PARITY OK" if self.ok else "PARITY FAILED")
            + f": max |dlogit| {self.max_abs_logit_error:.3e} (atol {self.atol:g} + rtol {self.rtol:g} * |dense|), "
            f"greedy tokens {'identical' if self.tokens_identical else 'differ'}"
        )
        return "\n".join(lines)


def compare_runs(original: GreedyRun, converted: GreedyRun, *, rtol: float, atol: float) -> ParityResult:
    """``converted`` against ``original`` (same prompts, same number of steps), logits in float32."""
    if len(original.tokens) != len(converted.tokens):
        raise ValueError(
            f"parity: expected runs over the same prompts, got {len(original.tokens)} and {len(converted.tokens)}"
        )
    n_steps = max((len(t) for t in original.tokens), default=0)
    steps, within = [], True
    for step in range(n_steps):
        pairs = [
            (g[step], r[step])
            for g, r in zip(converted.logits, original.logits, strict=True)
            if step < min(len(g), len(r))
        ]
        errs = [float(np.abs(g - r).max()) for g, r in pairs]
        within = within and all(bool((np.abs(g - r) <= atol + rtol * np.abs(r)).all()) for g, r in pairs)
        agree = sum(
            step < len(g) and step < len(r) and g[step] == r[step]
            for g, r in zip(converted.tokens, original.tokens, strict=True)
        )
        steps.append(StepReport(step, max(errs) if errs else 0.0, agree))
    identical = all(g == r for g, r in zip(converted.tokens, original.tokens, strict=True))
    worst = max((s.max_abs_logit_error for s in steps), default=0.0)
    return ParityResult(identical and within, worst, identical, len(original.tokens), atol, rtol, steps)


def default_prompts(thresholds: list[int] | tuple[int, ...]) -> list[list[int]]:
    """Three short prompts, and one longer than every length threshold of the original (LongRoPE's original
    length, a sliding window), so that parity also covers the branch a short prompt never reaches."""
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    if thresholds:
        prompts.append([11 + i % 64 for i in range(max(thresholds) + 8)])
    return prompts
