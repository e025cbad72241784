"""The proof of a split: the chain of stages computes the unsplit model's function.

Both run the same greedy loop (:func:`ortpa.parity.greedy.paged_greedy`: seeded prompts of different lengths in
one packed prefill, then packed decodes), the unsplit model first and alone, then the chain teacher-forced on its
tokens, so the two are never in memory together. Every logits row of the chain must lie within the structure
bound of :mod:`ortpa.tolerances` for float32 (a reordering of sums: the stages run the same nodes with the same
casts, but ONNX Runtime may fuse across what is now a cut), the model's longest dot product and its layers, and
every greedy token must be the unsplit model's, or a tie under the same bound. The arithmetic of that bound is the
coarsest the stages hand each other (:func:`handoff_arithmetic`): a float16 model hands on float16 hidden states,
rounded at every cut where the unsplit model may keep a fused sum wider, so its stages agree with it to float16's
structure bound, not float32's. Both run on the session options verification runs a model of that arithmetic with:
:func:`ortpa.parity.locate.lean_options` (no weight prepacking: the weights are read memory-mapped, not copied), and
for a half model :func:`ortpa.parity.reference.half_options` (ONNX Runtime's inserted float32 casts of the weights
neither folded at creation nor all run first: one float32 copy alive at a time; measured on a 0.62 GB float16
Llama's proof: 1551 MB of private memory with lean options alone, see docs/large_models.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from ortpa.errors import SplitRefused
from ortpa.parity.greedy import paged_greedy
from ortpa.parity.locate import lean_options
from ortpa.parity.reference import half_options
from ortpa.parity.twin import accumulation_length
from ortpa.providers import CPU
from ortpa.runtime.session import PagedSession
from ortpa.runtime.stage_chain import StageChain
from ortpa.runtime.stage_folder import StageManifest
from ortpa.tolerances import TieBound, structure_tolerance, unit_roundoff

__all__ = ["PROOF_PROMPT_LENGTHS", "SplitProof", "handoff_arithmetic", "prove_split"]

PROOF_PROMPT_LENGTHS = (3, 11, 21)  # across block boundaries of the proof's block size
PROOF_STEPS = 4
_BLOCK_SIZE = 4
_NUM_BLOCKS = 64


@dataclass(frozen=True)
class SplitProof:
    max_error: float  # max |chain - unsplit| over every logits row, relative to the row's scale
    bound: float  # the structure tolerance it was held to
    tokens: int  # greedy tokens compared
    ties: int  # tokens that differ at a tie


def handoff_arithmetic(manifest: StageManifest) -> str:
    """The coarsest floating type among the values that cross a cut (float32 when none is coarser)."""
    coarsest = "float32"
    for stage in manifest.stages:
        for t in stage.boundary_in:
            if t.dtype in ("float16", "bfloat16") and unit_roundoff(t.dtype) > unit_roundoff(coarsest):
                coarsest = t.dtype
    return coarsest


def prove_split(source: Path, header: onnx.ModelProto, manifest: StageManifest, *, seed: int = 0) -> SplitProof:
    """:class:`SplitRefused` when the chain of ``manifest``'s stages is not ``source``'s function."""
    vocab = next(o for o in header.graph.output if o.name == "logits").type.tensor_type.shape.dim[-1].dim_value
    rng = np.random.default_rng(seed)
    prompts = [[int(t) for t in rng.integers(0, max(2, vocab or 2), size=n)] for n in PROOF_PROMPT_LENGTHS]
    # verification's options: a float16 hand-off runs as verification runs a half model
    options = half_options() if handoff_arithmetic(manifest) != "float32" else lean_options()
    unsplit = PagedSession(
        source,
        num_blocks=_NUM_BLOCKS,
        block_size=_BLOCK_SIZE,
        providers=[CPU],
        sess_options=options,
    )
    reference = paged_greedy(unsplit, prompts, PROOF_STEPS, block_size=_BLOCK_SIZE)
    del unsplit  # one model in memory at a time
    chain = StageChain(
        manifest,
        num_blocks=_NUM_BLOCKS,
        block_size=_BLOCK_SIZE,
        providers=[CPU],
        sess_options=options,
    )
    run = paged_greedy(chain, prompts, PROOF_STEPS, block_size=_BLOCK_SIZE, follow=reference.tokens)  # type: ignore[arg-type]
    del chain
    # the stages run the unsplit model's nodes with its casts: only sums ONNX Runtime fuses across a cut may be
    # reordered, and a hidden state handed on is rounded to its type where the unsplit model may keep it wider
    tol = structure_tolerance(handoff_arithmetic(manifest), accumulation_length(header), manifest.layers)
    ties = TieBound(tol, tol)  # margin 2 * tol * (1 + |top|): the bound at the row's scale, twice
    worst, tie_count, compared = 0.0, 0, 0
    for p, (ref_rows, rows) in enumerate(zip(reference.logits, run.logits, strict=True)):
        for step, (ref, got) in enumerate(zip(ref_rows, rows, strict=True)):
            scale = max(1.0, float(np.abs(ref).max()))
            err = float(np.abs(got - ref).max()) / scale
            worst = max(worst, err)
            if err > tol:
                raise SplitRefused(
                    manifest.source,
                    f"the stages' logits differ from the unsplit model's by {err:.3g} of their scale (bound {tol:.3g}) "
                    f"for prompt {p} (length {len(prompts[p])}) at step {step}",
                )
            compared += 1
            token = run.tokens[p][step]
            verdict = ties.classify(ref, token)
            if verdict == "mismatch":
                raise SplitRefused(
                    manifest.source,
                    f"greedy token {token} of the stages differs from the unsplit model's {reference.tokens[p][step]} "
                    f"for prompt {p} at step {step}, outside a tie",
                )
            tie_count += verdict == "tie"
    return SplitProof(worst, tol, compared, tie_count)
