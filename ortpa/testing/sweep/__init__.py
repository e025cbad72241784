"""A seeded sweep over each family's config space: convert with verification on, then greedy tokens batched,
alone and of the original (``python -m ortpa.testing.sweep``; ``docs/sweep.md``)."""

from __future__ import annotations

from ortpa.testing.sweep.judge import Judgement, judge_conversion, sweep_prompts
from ortpa.testing.sweep.run import OUTCOMES, Outcome, classify_refusal, run_draw
from ortpa.testing.sweep.space import FAMILIES, Draw, draw

__all__ = [
    "FAMILIES",
    "OUTCOMES",
    "Draw",
    "Judgement",
    "Outcome",
    "classify_refusal",
    "draw",
    "judge_conversion",
    "run_draw",
    "sweep_prompts",
]
