"""The sweep's verdict on one conversion: greedy tokens batched, alone and of the original, under the tie rule.

The original (the dense export, run by ONNX Runtime on CPU one prompt at a time) decides each step's token; the
converted model runs every prompt batched in one paged step, then each prompt alone, both fed the original's
tokens (teacher forcing, :func:`ortpa.parity.paged_greedy`'s ``follow``) so that a flip is judged at its own
step. A token of the converted model that is not the original's is a tie only if the original's gap between the
two is within :class:`ortpa.tolerances.TieBound`'s margin, and ties stay rare (:func:`max_tie_flips`). The margin
is the converted dtype's tolerance (:func:`ortpa.tolerances.tol_for`), unless the original computes coarser
than that itself: an original whose projections quantize activations to int8 (onnxruntime-genai's int4 builds,
MatMulNBits ``accuracy_level=4``) differs from itself by a few hundredths of a logit between an incremental and a
one-shot run of the same tokens, so its comparisons take the tie rule of int8 arithmetic
(:func:`ortpa.tolerances.precision_ties`, the rule verification applies to such originals); batched
tokens are held to the same rule against the same prompts run alone (batched = alone). Logit errors are recorded,
not judged: verification owns the logit bound; the sweep asks only whether the written model gives the
original's greedy tokens.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ortpa.model.file import read_model
from ortpa.parity import GreedyRun, compare_runs, dense_greedy, open_dense, paged_greedy
from ortpa.parity.twin import source_arithmetic
from ortpa.runtime.session import PagedSession
from ortpa.tolerances import precision_ties, tol_for, unit_roundoff

__all__ = ["Judgement", "judge_conversion", "sweep_prompts", "tie_tolerance"]

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Judgement:
    """``correct``: no token of the converted model, batched or alone, outside the tie rule."""

    correct: bool
    reason: str  # empty when correct; else which comparison failed, at which step and sequence
    max_abs_logit_error: float  # converted batched against the original, over every checked row
    batched_vs_alone: float  # max |dlogit| between the converted model batched and alone
    tokens: int  # checked tokens per comparison


def sweep_prompts(vocab: int, thresholds: Sequence[int], seed: int) -> list[list[int]]:
    """Four seeded prompts of different lengths: three short ones and one past every length threshold."""
    rng = np.random.default_rng(seed)
    long = max([16, *thresholds]) + 5
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in (5, 2, 9, long)]


def tie_tolerance(dtype: str, original_arithmetic: str) -> tuple[float, float]:
    """``(rtol, atol)`` of the tie rule: ``dtype``'s tolerance, or the tie rule of the original's own arithmetic
    where that is coarser (int8 activations)."""
    if unit_roundoff(original_arithmetic) > unit_roundoff(dtype):
        bound = precision_ties(original_arithmetic)
        return bound.rtol, bound.atol
    return tol_for(dtype)


def _verdict(name: str, reference: GreedyRun, run: GreedyRun, tol: tuple[float, float]) -> tuple[str, float]:
    """``(reason or "", max |dlogit|)`` of ``run`` against ``reference`` under the tie rule of ``tol``."""
    rtol, atol = tol
    result = compare_runs(reference, run, rtol=rtol, atol=atol)
    if result.mismatches == 0 and result.ties <= result.max_ties:
        return "", result.max_abs_logit_error
    for step in result.steps:
        if step.mismatches:
            return (
                f"{name}: step {step.step}: {step.mismatches} token(s) outside the tie rule "
                f"(max |dlogit| {step.max_abs_logit_error:.3g}, smallest top-2 gap {step.min_top_gap:.3g})",
                result.max_abs_logit_error,
            )
    return f"{name}: {result.ties} tie flips, at most {result.max_ties} allowed", result.max_abs_logit_error


def judge_conversion(
    dense: str | os.PathLike,
    converted: str | os.PathLike,
    prompts: Sequence[Sequence[int]],
    *,
    steps: int = 6,
    dtype: str = "float16",
) -> Judgement:
    """``converted`` (a paged model file) against its original ``dense``, on ``prompts`` for ``steps`` tokens.

    ``dtype``: the converted model's activation dtype, whose tolerance sets the tie margin (or the original's
    own arithmetic, where coarser: :func:`tie_tolerance`)."""
    tol = tie_tolerance(dtype, source_arithmetic(read_model(dense, load_external_data=False).proto))
    opened = open_dense(dense, threads=2)  # its interface: how a genai, optimum or OnnxExporter file is fed
    original = dense_greedy(opened.session, prompts, steps, interface=opened.interface)
    del opened
    blocks = sum(-(-(len(p) + steps) // BLOCK_SIZE) for p in prompts) + len(prompts)
    session = PagedSession(os.fspath(converted), num_blocks=blocks, block_size=BLOCK_SIZE)
    batched = paged_greedy(session, prompts, steps, follow=original.tokens)
    alone_runs = [paged_greedy(session, [p], steps, follow=[t]) for p, t in zip(prompts, original.tokens, strict=True)]
    alone = GreedyRun(
        [r.tokens[0] for r in alone_runs], [r.logits[0] for r in alone_runs], sum(r.seconds for r in alone_runs), 0
    )
    tokens = sum(len(t) for t in original.tokens)
    why_b, err_b = _verdict("batched vs original", original, batched, tol)
    why_a, _ = _verdict("alone vs original", original, alone, tol)
    why_ba, err_ba = _verdict("batched vs alone", alone, batched, tol)
    reasons = [w for w in (why_b, why_a, why_ba) if w]
    return Judgement(not reasons, "; ".join(reasons), err_b, err_ba, tokens)
