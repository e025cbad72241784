"""The sweep's verdict on one conversion: greedy tokens batched, alone and of the original, under the tie rule.

The original (the dense export, run by ONNX Runtime on CPU one prompt at a time) decides each step's token; the
converted model runs every prompt batched in one paged step, then each prompt alone, both fed the original's
tokens (teacher forcing, :func:`ortpa.parity.paged_greedy`'s ``follow``) so that a flip is judged at its own
step. A token of the converted model that is not the original's is a tie only if the original's gap between the
two is within :class:`ortpa.tolerances.TieBound`'s margin, and ties stay rare (:func:`max_tie_flips`). The margin
is the converted dtype's tolerance (:func:`ortpa.tolerances.tol_for`), unless the original computes coarser
than that itself.

An original whose projections quantize activations to int8 (onnxruntime-genai's int4 builds, MatMulNBits
``accuracy_level=4``) moves its logits by about a tenth of a nat against the same weights with float32
activations: a cache value rounded to float16 moves an activation across an int8 rounding step (one step is
1/127 of a block's largest value), and that step, not the conversion, sets how far the deployed model's logits
move. On the sweep's random-weight models, where near ties are common, that flips a top-2 pair now and then
(genai mistral and qwen2 seed 0: 1 and 2 of 24 tokens, at gaps 0.024, 0.019 and 0.0026 nats; docs/sweep.md).
So such a conversion is judged twice:

* as deployed, against the original, under the tie rule of int8 arithmetic
  (:func:`ortpa.tolerances.precision_ties`, the rule verification applies to such originals): a flip outside
  that margin is wrong; flips within it are counted and reported, not capped, because int8's step, not the
  conversion, makes them;
* with float32 activations on both sides (:func:`float32_activations`: the same int4 weights, ``accuracy_level``
  0), under the converted dtype's own tie rule and its cap on tie flips: what the conversion itself changes,
  with nothing to amplify it. A structural mistake (a scale, a window, a RoPE) is caught here at float16's
  margin.

Logit errors are recorded, not judged: verification owns the logit bound; the sweep asks only whether the written
model gives the original's greedy tokens.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ortpa.model.file import read_model
from ortpa.parity import GreedyRun, compare_runs, dense_greedy, open_dense, paged_greedy
from ortpa.parity.activations import switch_to_float32_activations
from ortpa.parity.twin import source_arithmetic
from ortpa.runtime.session import PagedSession
from ortpa.tolerances import precision_ties, tol_for, unit_roundoff

__all__ = ["Judgement", "float32_activations", "judge_conversion", "sweep_prompts", "tie_tolerance"]

BLOCK_SIZE = 16


@dataclass(frozen=True)
class Judgement:
    """``correct``: no token of the converted model, batched or alone, outside the tie rule."""

    correct: bool
    reason: str  # empty when correct; else which comparison failed, at which step and sequence
    max_abs_logit_error: float  # converted batched against the original, over every checked row
    batched_vs_alone: float  # max |dlogit| between the converted model batched and alone
    tokens: int  # checked tokens per comparison
    # an int8-activation original: converted against original with float32 activations on both sides (None: not run)
    float32_activations_error: float | None = None
    int8_ties: int = 0  # tie flips of the deployed model under int8's rule, reported (not capped) where that ran


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


def _verdict(
    name: str, reference: GreedyRun, run: GreedyRun, tol: tuple[float, float], *, capped: bool = True
) -> tuple[str, float, int]:
    """``(reason or "", max |dlogit|, tie flips)`` of ``run`` against ``reference`` under the tie rule of ``tol``;
    ``capped``: tie flips count against :func:`ortpa.tolerances.max_tie_flips`."""
    rtol, atol = tol
    result = compare_runs(reference, run, rtol=rtol, atol=atol)
    if result.mismatches == 0 and (result.ties <= result.max_ties or not capped):
        return "", result.max_abs_logit_error, result.ties
    for step in result.steps:
        if step.mismatches:
            return (
                f"{name}: step {step.step}: {step.mismatches} token(s) outside the tie rule "
                f"(max |dlogit| {step.max_abs_logit_error:.3g}, smallest top-2 gap {step.min_top_gap:.3g})",
                result.max_abs_logit_error,
                result.ties,
            )
    return (
        f"{name}: {result.ties} tie flips, at most {result.max_ties} allowed",
        result.max_abs_logit_error,
        result.ties,
    )


@contextmanager
def float32_activations(model: str | os.PathLike) -> Iterator[Path | None]:
    """A copy of the model file ``model`` whose MatMulNBits compute with float32 activations (``accuracy_level``
    0: the same int4 weights, dequantized, times unquantized activations), written next to it so that its
    external data resolves, and removed on exit. ``None`` where ``model`` quantizes activations some other way
    (dynamic quantization's ``MatMulInteger``: no attribute turns it off) or not at all."""
    path = Path(model)
    proto = onnx.load(str(path), load_external_data=False)
    if not switch_to_float32_activations(proto):
        yield None
        return
    copy = path.with_name(f"{path.stem}.float32-activations{path.suffix}")
    onnx.save(proto, str(copy))
    try:
        yield copy
    finally:
        copy.unlink(missing_ok=True)


def _paged_runs(converted: Path, prompts, steps: int, follow) -> tuple[GreedyRun, GreedyRun]:
    """The converted model's runs, every prompt batched in one paged step and each prompt alone."""
    blocks = sum(-(-(len(p) + steps) // BLOCK_SIZE) for p in prompts) + len(prompts)
    session = PagedSession(os.fspath(converted), num_blocks=blocks, block_size=BLOCK_SIZE)
    batched = paged_greedy(session, prompts, steps, follow=follow)
    alone_runs = [paged_greedy(session, [p], steps, follow=[t]) for p, t in zip(prompts, follow, strict=True)]
    alone = GreedyRun(
        [r.tokens[0] for r in alone_runs], [r.logits[0] for r in alone_runs], sum(r.seconds for r in alone_runs), 0
    )
    return batched, alone


def _dense_run(dense: Path, prompts, steps: int, follow=None) -> GreedyRun:
    opened = open_dense(dense, threads=2)  # its interface: how a genai, optimum or OnnxExporter file is fed
    return dense_greedy(opened.session, prompts, steps, follow=follow, interface=opened.interface)


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
    own arithmetic, where coarser: :func:`tie_tolerance`; an int8-activation original is judged twice, see the
    module's text)."""
    dense, converted = Path(dense), Path(converted)
    arithmetic = source_arithmetic(read_model(dense, load_external_data=False).proto)
    tol = tie_tolerance(dtype, arithmetic)
    original = _dense_run(dense, prompts, steps)
    batched, alone = _paged_runs(converted, prompts, steps, original.tokens)
    tokens = sum(len(t) for t in original.tokens)
    coarser = tol != tol_for(dtype)
    with float32_activations(dense) as dense32, float32_activations(converted) as converted32:
        # int8's step, not the conversion, makes the deployed model's ties where the float32-activation pair runs
        capped = not (coarser and dense32 is not None and converted32 is not None)
        why_b, err_b, ties = _verdict("batched vs original", original, batched, tol, capped=capped)
        why_a, _, _ = _verdict("alone vs original", original, alone, tol, capped=capped)
        why_ba, err_ba, _ = _verdict("batched vs alone", alone, batched, tol, capped=capped)
        reasons = [w for w in (why_b, why_a, why_ba) if w]
        err32 = None
        if not capped:
            original32 = _dense_run(dense32, prompts, steps, follow=original.tokens)
            batched32, _ = _paged_runs(converted32, prompts, steps, original.tokens)
            why32, err32, _ = _verdict(
                "float32 activations, batched vs original", original32, batched32, tol_for(dtype)
            )
            reasons += [why32] if why32 else []
    return Judgement(not reasons, "; ".join(reasons), err_b, err_ba, tokens, err32, 0 if capped else ties)
