"""The conversion's own proof: a converted model against its original, before the converted model is written.

:func:`verify_conversion` runs the original alone, in its own format (:func:`~ortpa.parity.greedy.dense_greedy`),
on a few seeded prompts — a short one, a longer one, and one past every length threshold of the original
(:func:`ortpa.formats.length_thresholds`) — for a few greedy steps; then the converted model batched
(:func:`~ortpa.parity.greedy.paged_greedy`), and its float32 twin (:mod:`ortpa.parity.twin`: the same rewrite with
attention and caches in float32), both teacher-forced on the original's tokens. An original that computes in
float16 itself gets a float32 twin too (:func:`~ortpa.parity.twin.float32_original`), which the conversion's twin
is compared with, and which replaces it as the reference: its greedy run, not the half original's
(:func:`ortpa.parity.reference.twin_reference`); so does a float32 original whose conversion computes in float16
throughout (``dtype=``: its twin computes from its weights rounded as the conversion stores them,
:func:`~ortpa.parity.rounded.rounded_original`). A ``--portable`` file's twin is its header upcast (its lowered
functions run in float32). The one rule
(:mod:`ortpa.parity.rule`, bounds in :mod:`ortpa.tolerances`) decides: *structure* on the twin at a float32
bound relative to each logits row's scale, *precision* of the deployed model by token agreement under the tie
rule, top-k overlap and KL divergence within a bound derived from its dtype. No bound depends on the model's
size, depth or family. Where precision alone would refuse, steps a mixture-of-experts router's near-tie explains
are looked for (:mod:`ortpa.parity.routing`) and excused as routing ties.

On a structural mismatch the error names the first layer whose output diverges (:mod:`ortpa.parity.locate`).

Memory: the sessions open from their paths one after the other (the original, the converted model, its twin),
with ONNX Runtime's weight prepacking off, so the weights stay memory-mapped from their files (read, not copied
into private memory) and convert's memory bound holds with verification. The twin changes the graph header only.
"""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx

from ortpa.errors import ConversionError
from ortpa.model.file import LoadedModel
from ortpa.parity.activations import switch_to_float32_activations
from ortpa.parity.greedy import dense_greedy, paged_greedy
from ortpa.parity.locate import first_diverging_layer
from ortpa.parity.locate import lean_options as _lean_options
from ortpa.parity.locate import twin_options as _twin_options
from ortpa.parity.reference import BLOCK_SIZE as _BLOCK_SIZE
from ortpa.parity.reference import (
    Deployment,
    Reference,
    declared_cache_dtype,
    dense_twin_run,
    half_options,
    open_original,
    original_options,
    paged_session,
    twin_reference,
)
from ortpa.parity.rounded import rounded_original
from ortpa.parity.routing import routing_ties
from ortpa.parity.rule import Verdict, judge, judge_precision
from ortpa.parity.twin import float32_original, float32_twin, is_lowered_call, source_arithmetic
from ortpa.tolerances import UNIT_ROUNDOFF

__all__ = [
    "DEFAULT_STEPS",
    "Deployment",
    "Reference",
    "Twins",
    "Verification",
    "diverging_layer",
    "first_diverging_layer",
    "prove",
    "reference_run",
    "run_rule",
    "verification_blocks",
    "verification_prompts",
    "verify_conversion",
]

DEFAULT_STEPS = 3  # greedy steps: the prefill and two decodes (the first decode reads the cache the prefill wrote)


@dataclass
class Verification:
    """What :func:`verify_conversion` found: the rule's verdict (structure and precision), the cost."""

    verdict: Verdict
    seconds: float
    steps: int
    prompt_lengths: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verdict.ok

    @property
    def max_abs_logit_error(self) -> float:
        return self.verdict.precision.max_abs_logit_error

    def summary(self) -> dict:
        """The figures for the ``--json`` result and the model's metadata."""
        return {
            **self.verdict.to_dict(),
            "max_abs_logit_error": self.max_abs_logit_error,
            "tie_flips": self.verdict.precision.ties,
            "routing_ties": self.verdict.precision.routing_ties,
            "prompt_lengths": self.prompt_lengths,
            "steps": self.steps,
            "seconds": round(self.seconds, 3),
        }

    def metadata(self) -> dict[str, str]:
        return {
            "ortpa.verified": "1",
            **self.verdict.metadata(),
            "ortpa.verify.prompt_lengths": ",".join(str(n) for n in self.prompt_lengths),
            "ortpa.verify.steps": str(self.steps),
        }


def verification_prompts(thresholds: Sequence[int]) -> list[list[int]]:
    """A short prompt, a longer one (past one cache block, so the op reads two blocks), and one past every
    length threshold of the original. Seeded (fixed) token ids below 64: every fixture's vocabulary has them."""
    rng = np.random.default_rng(24)
    prompts = [[int(t) for t in rng.integers(1, 64, 3)], [int(t) for t in rng.integers(1, 64, _BLOCK_SIZE + 3)]]
    if thresholds:
        prompts.append([int(t) for t in rng.integers(1, 64, max(thresholds) + 3)])
    return prompts


def verify_conversion(
    original: str | os.PathLike,
    converted: str | os.PathLike,
    *,
    steps: int = DEFAULT_STEPS,
    progress: Callable[[str], None] | None = None,
) -> Verification:
    """Run ``converted`` and its float32 twin against ``original`` (paths); raise :class:`ConversionError`
    (naming the first diverging layer where the structure differs) when the rule refuses, else return the
    figures."""
    import time

    from ortpa.formats.detect import length_thresholds
    from ortpa.model.file import read_model

    start = time.perf_counter()
    proto = read_model(original, load_external_data=False).proto
    prompts = verification_prompts(length_thresholds(proto))
    if progress is not None:
        progress(f"verifying against the original ({len(prompts)} prompts, {steps} greedy steps)")
    del proto
    verdict, twins, want = prove(original, converted, prompts, steps, verification_blocks(prompts, steps))
    verification = Verification(verdict, time.perf_counter() - start, steps, [len(p) for p in prompts])
    if not verdict.ok:
        raise _refusal(original, converted, twins, prompts, want, verdict)
    return verification


def verification_blocks(prompts, steps: int, block_size: int = _BLOCK_SIZE) -> int:
    """Cache blocks enough for ``prompts`` and ``steps`` new tokens each, one sequence per block table, plus one."""
    return sum(-(-(len(p) + steps) // block_size) for p in prompts) + 1


def prove(original, converted, prompts, steps: int, blocks: int, deployment: Deployment | None = None):
    """The one rule on ``converted`` against ``original`` (paths) over ``prompts``, ``steps`` greedy steps: what
    ``convert``'s verification and ``ortpa parity`` both run. The reference (:func:`reference_run`), then
    :func:`run_rule`. ``deployment``: where the deployed model runs (default: CPU, ``blocks`` blocks). Returns
    the :class:`~ortpa.parity.rule.Verdict`, the :class:`Twins` judged and the reference's run."""
    want, reference = reference_run(original, converted, prompts, steps, blocks, deployment)
    verdict, twins = run_rule(original, converted, prompts, want, blocks, deployment=deployment, reference=reference)
    return verdict, twins, want


def reference_run(original, converted, prompts, steps: int, blocks: int, deployment: Deployment | None = None):
    """The run every other run is fed and judged against, and its :class:`Reference` (None: the original's own
    run). A float32 original runs itself, alone in its own format; an original that computes in a half type is
    not run: its float32 twin's greedy run is the reference (:func:`~ortpa.parity.reference.twin_reference`,
    drafted by the deployed model's tokens)."""
    from ortpa.model.file import read_model

    if _computes_in_half(read_model(original, load_external_data=False).proto):
        return twin_reference(original, converted, prompts, steps, blocks, deployment)
    session, interface = open_original(original)
    want = dense_greedy(session, prompts, steps, interface=interface)
    del session
    gc.collect()
    return want, None


@dataclass
class Twins:
    """The float32 twins :func:`run_rule` judged: ``converted`` (None where the deployed model was its own twin),
    ``original`` (where the original computes in a half type; else the original itself is the reference)."""

    converted: LoadedModel | None = None
    original: LoadedModel | None = None


def _computes_in_half(proto: onnx.ModelProto) -> bool:
    return source_arithmetic(proto) in ("float16", "bfloat16")


def _coarsest(*arithmetic: str) -> str:
    """The arithmetic of largest unit roundoff among ``arithmetic`` (names of :data:`UNIT_ROUNDOFF`)."""
    return max(arithmetic, key=lambda a: UNIT_ROUNDOFF[a])


def run_rule(original, converted, prompts, want, blocks: int, *, deployment: Deployment | None = None, reference=None):
    """The rule on ``converted`` against the original's run ``want`` (over ``prompts``): the deployed model (where
    ``deployment`` says, default CPU) and then its float32 twin, each teacher-forced on ``want``'s tokens.
    ``reference``: a :class:`Reference`, where ``want`` is the run of a half original's float32 twin
    (:func:`twin_reference`) rather than of the original. Returns the :class:`~ortpa.parity.rule.Verdict` and
    the :class:`Twins` that were judged."""
    from ortpa.model.file import read_model

    twins = Twins()
    deployment = deployment or Deployment(blocks)
    steps = max(len(t) for t in want.tokens)
    source = source_arithmetic(read_model(original, load_external_data=False).proto)
    header = read_model(converted, load_external_data=False)
    # an original that computes in a half type gets its own float32 twin, run on the same tokens: both sides
    # then differ only by the rewrite and reordered float32 sums. So does a float32 original whose conversion
    # computes in T throughout (dtype=): its twin computes in float32 from its weights rounded to T, as the
    # conversion stores them
    half = source in ("float16", "bfloat16")
    rounded = source == "float32" and source_arithmetic(header.proto) in ("float16", "bfloat16")
    upcast = half or rounded
    if reference is not None and reference.deployed is not None:
        got, cache_dtype = reference.deployed, reference.cache_dtype  # already fed want's tokens
    else:
        paged = deployment.open(converted, half_options() if upcast else _lean_options())
        cache_dtype = declared_cache_dtype(paged)
        got = paged_greedy(paged, prompts, steps, follow=want.tokens)
        del paged
        gc.collect()
    accounted: set[str] = set()  # the conversion's copies of the original's constants, rounded in both twins
    if reference is not None:
        twins.original = reference.model
    elif upcast and _has_attention(header.proto):
        if rounded:
            twins.original, accounted = rounded_original(original, header)
        else:
            twins.original = float32_original(original)
    twin = float32_twin(converted, upcast=upcast, original=twins.original, accounted=accounted)
    # an original that quantizes activations to int8 (genai's int4 builds): both twins with float32 activations,
    # compared at the float32 bound (ortpa.parity.activations); the deployed model's ties are then int8's
    activations32 = False
    if source == "int8" and twin.model is not None and reference is None:
        plain = read_model(original, load_external_data=False)
        if switch_to_float32_activations(plain.proto, twin.model.proto):
            twins.original = dataclasses.replace(plain, label=f"{plain.label} (float32 activations)")
            activations32 = True
    del header
    twin_run = twin_original = None
    if twin.model is not None:
        twins.converted = twin.model
        if reference is not None:
            twin_original = want  # the reference is the original's twin's own run
        elif twins.original is not None:
            twin_original = dense_twin_run(twins.original, prompts, steps, want.tokens)
        twin_session = paged_session(twin.model, blocks, _twin_options() if upcast else _lean_options())
        twin_run = paged_greedy(twin_session, prompts, steps, follow=want.tokens)
        del twin_session
        gc.collect()
    # without a separate twin the deployed model is judged as its own, in its own arithmetic (an int8-activation
    # original; a --portable file whose int8 cache is quantized inside its functions)
    if twin.model is None:
        arithmetic = _coarsest(source, twin.arithmetic, cache_dtype)
    else:
        arithmetic = "float32" if upcast or activations32 else _coarsest(source, "float32")
    # the deployed T's rounding feeds whatever the original quantizes (int8 activations): judged at the coarser
    precision = _coarsest(cache_dtype, source)
    verdict = judge(
        want,
        got,
        precision,
        twin=twin_run,
        twin_original=twin_original,
        arithmetic=arithmetic,
        accumulation=twin.accumulation,
        layers=twin.layers,
        reason=twin.reason,
        computed=twin.computed,
        stored=twin.stored,
        cap_ties=not activations32,
    )
    if verdict.structure.ok and not verdict.precision.ok:
        # a float16 router's near-tie picks other experts for a token: the routing analogue of a greedy tie. Only
        # looked for where the precision check would refuse (a passing model needs no excuse; the probes cost two
        # more runs)
        try:
            routed = reference.model if reference is not None else original  # the run ``want`` came from
            ties = _routing_ties(routed, converted, prompts, want, precision, half, deployment)
        except Exception:  # the probes are an excuse looked for, never a new way to fail: the verdict stands
            ties = set()
        if ties:
            verdict = Verdict(
                verdict.structure, judge_precision(want, got, precision, ties, cap_ties=not activations32)
            )
    return verdict, twins


def _routing_ties(original, converted, prompts, want, dtype, upcast, deployment: Deployment) -> set:
    """:func:`ortpa.parity.routing.routing_ties` with the session options and providers of the rule's own runs."""
    steps = max(len(t) for t in want.tokens)
    ties, _ = routing_ties(
        original,
        converted,
        prompts,
        want.tokens,
        steps,
        dtype,
        original_options=original_options(upcast),
        paged_options=half_options() if upcast else _lean_options(),
        blocks=deployment.blocks,
        block_size=deployment.block_size,
        providers=deployment.provider_list,
    )
    return ties


def _has_attention(converted: onnx.ModelProto) -> bool:
    """Whether ``converted`` has a PagedAttention node, or one lowered to its portable function (``--portable``)."""
    return any(n.op_type == "PagedAttention" or is_lowered_call(n) for n in converted.graph.node)


# ------------------------------------------------------------------------------------------ the first layer
def diverging_layer(original, converted, twins: Twins, prompts, want, structure) -> str:
    """Where a structural refusal (``structure``, failed) starts: the first layer whose output diverges
    (:func:`~ortpa.parity.locate.first_diverging_layer`), on one prefill of the failing prompt and the
    reference's tokens up to the failing step; the twins that were judged where there were. Never raises: the
    diagnosis must not hide the verdict."""
    prompt, step = structure.first_failure or (0, 0)
    # the prompt and the reference's tokens up to the step: one prefill reaches what the decode steps did
    tokens = list(prompts[prompt]) + list(want.tokens[prompt][:step])
    try:
        # where the original computes in a half type, the twin is compared with the original's own twin
        return first_diverging_layer(
            twins.original if twins.original is not None else original,
            twins.converted if twins.converted is not None else converted,
            tokens,
            structure.tolerance,
        )
    except Exception as exc:
        return f"not located ({type(exc).__name__}: {str(exc)[:200]})"


def _refusal(original, converted, twins: Twins, prompts, want, verdict: Verdict) -> ConversionError:
    """The error for a refused verification: the figures, and the first diverging layer where the structure
    differs."""
    st, pr = verdict.structure, verdict.precision
    details = [("structure", verdict.format().splitlines()[0]), ("precision", verdict.format().splitlines()[1])]
    if not st.ok:
        prompt, step = st.first_failure or (0, 0)
        details.insert(0, ("first differing step", f"{step} (prompt {prompt}, {len(prompts[prompt])} tokens)"))
        details.insert(0, ("first diverging layer", diverging_layer(original, converted, twins, prompts, want, st)))
        what = "the converted model does not match the original (structure)"
    else:
        what = (
            f"the converted model matches the original in float32, but its {pr.dtype} precision costs more than "
            "the rule allows"
        )
    return ConversionError(f"{what}; nothing was written (pass --no-verify / verify=False to write it anyway)", details)
