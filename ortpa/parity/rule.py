"""The verification rule, one for ``convert``, ``ortpa parity``, ``ortpa demo`` and the tests.

Two verdicts, kept apart (the bounds and their derivation: :mod:`ortpa.tolerances`):

* :func:`judge_structure`: the conversion's float32 twin (:mod:`ortpa.parity.twin`) against the original, each
  logits row within :func:`ortpa.tolerances.structure_bound`. Decides whether the rewrite is right.
* :func:`judge_precision`: the deployed model against the original: greedy agreement under the tie rule of its
  precision, top-k overlap and KL divergence of the next-token distributions. Decides whether the deployed
  precision keeps the model, refusing only past :func:`ortpa.tolerances.precision_kl_bound` or at a token
  flip outside :func:`ortpa.tolerances.precision_ties`. Steps a router's near-tie explains (routing ties,
  :mod:`ortpa.parity.routing`) are reported, not judged, and counted with the token ties.

Both take :class:`~ortpa.parity.greedy.GreedyRun` s over the same prompts, the compared run teacher-forced on the
original's tokens (``follow=original.tokens``), so every step compares the same inputs.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass

import numpy as np

from ortpa.parity.greedy import GreedyRun
from ortpa.tolerances import (
    PRECISION_TOP_K,
    max_tie_flips,
    precision_kl_bound,
    precision_logit_bound,
    precision_ties,
    structure_tolerance,
)

__all__ = [
    "PrecisionResult",
    "StructureResult",
    "Verdict",
    "judge",
    "judge_precision",
    "judge_structure",
    "kl_divergence",
]


@dataclass(frozen=True)
class StructureResult:
    """The twin against the original: the worst error relative to each row's scale, against the bound."""

    ok: bool
    arithmetic: str  # what the twin computes in: "float32", or the deployed T where it is its own twin
    twin: bool  # a separate float32 twin ran (False: the deployed model was judged as its own twin)
    max_abs_error: float
    max_relative_error: float  # max over rows of max |d| / max(1, max |original row|)
    tolerance: float  # the bound on max_relative_error (ortpa.tolerances.structure_tolerance)
    first_failure: tuple[int, int] | None = None  # (prompt, step) of the first row past the bound
    reason: str = ""  # why no separate twin ran


@dataclass(frozen=True)
class PrecisionResult:
    """The deployed model against the original, in statistics that mean the same on any model."""

    ok: bool
    dtype: str
    tokens_checked: int
    tokens_agree: int
    ties: int
    mismatches: int
    max_ties: int
    kl_max: float
    kl_mean: float
    kl_bound: float
    top_k: int
    top_k_overlap_min: float
    top_k_overlap_mean: float
    max_abs_logit_error: float  # reported, not judged
    logit_bound: float  # the tie rule's b (ties within 2 b)
    # steps excused as routing ties (ortpa.parity.routing): not judged, counted against max_ties with ``ties``
    routing_ties: int = 0
    routing_tie_steps: tuple[tuple[int, int], ...] = ()  # (prompt, step) of each
    routing_tie_kl_max: float = 0.0  # the excused steps' KL, reported, not judged
    # False where the structure was proved with float32 activations on both sides (an int8-activation original,
    # ortpa.parity.activations): int8's step, not the conversion, makes the deployed model's near-ties flip, so
    # ties within the margin are reported, not capped
    ties_capped: bool = True


@dataclass(frozen=True)
class Verdict:
    structure: StructureResult
    precision: PrecisionResult

    @property
    def ok(self) -> bool:
        return self.structure.ok and self.precision.ok

    def to_dict(self) -> dict:
        return {"ok": self.ok, "structure": asdict(self.structure), "precision": asdict(self.precision)}

    def metadata(self) -> dict[str, str]:
        s, p = self.structure, self.precision
        return {
            "ortpa.verify.structure": f"{'float32 twin' if s.twin else s.arithmetic}: max |d| / scale "
            f"{s.max_relative_error:.3e} <= {s.tolerance:.3e}",
            "ortpa.verify.precision": f"{p.dtype}: KL max {p.kl_max:.3e} <= {p.kl_bound:.3e}, tokens "
            f"{p.tokens_agree}/{p.tokens_checked} ({p.ties} ties), top-{p.top_k} overlap min {p.top_k_overlap_min:.2f}",
            "ortpa.verify.kl_max": f"{p.kl_max:.3e}",
            "ortpa.verify.top_k_overlap_min": f"{p.top_k_overlap_min:.3f}",
            "ortpa.verify.max_abs_logit_error": f"{p.max_abs_logit_error:.3e}",
            "ortpa.verify.tie_flips": str(p.ties),
            "ortpa.verify.routing_ties": str(p.routing_ties),
        }

    def format(self) -> str:
        s, p = self.structure, self.precision
        twin = (
            (f"float32 twin; {s.reason}" if s.reason else "float32 twin")
            if s.twin
            else (f"the deployed model ({s.arithmetic}; {s.reason})")
        )
        return "\n".join(
            [
                f"structure ({twin}): max |d| {s.max_abs_error:.3e}, relative to the row's scale "
                f"{s.max_relative_error:.3e} (bound {s.tolerance:.3e}): {'OK' if s.ok else 'FAILED'}",
                f"precision ({p.dtype}): KL max {p.kl_max:.3e} mean {p.kl_mean:.3e} (bound {p.kl_bound:.3e}); "
                f"greedy tokens agree {p.tokens_agree}/{p.tokens_checked}"
                + (
                    f", {p.ties} tie(s) ({f'at most {p.max_ties}' if p.ties_capped else 'not capped'})"
                    if p.ties
                    else ""
                )
                + (
                    f"; {p.routing_ties} routing tie(s) excused (steps {list(p.routing_tie_steps)}, KL max "
                    f"{p.routing_tie_kl_max:.3e}; with ties at most {p.max_ties})"
                    if p.routing_ties
                    else ""
                )
                + (f", {p.mismatches} MISMATCH(ES)" if p.mismatches else "")
                + f"; top-{p.top_k} overlap min {p.top_k_overlap_min:.2f} mean {p.top_k_overlap_mean:.2f}; "
                f"max |dlogit| {p.max_abs_logit_error:.3e}: {'OK' if p.ok else 'FAILED'}",
                "VERIFIED" if self.ok else "NOT VERIFIED",
            ]
        )


def _pairs(original: GreedyRun, other: GreedyRun):
    """(prompt, step, original row, other row, other's token) over the steps both runs have."""
    if len(original.tokens) != len(other.tokens):
        raise ValueError(f"expected runs over the same prompts, got {len(original.tokens)} and {len(other.tokens)}")
    for p, (r_rows, g_rows, g_tok) in enumerate(zip(original.logits, other.logits, other.tokens, strict=True)):
        for step in range(min(len(r_rows), len(g_rows), len(g_tok))):
            yield p, step, np.asarray(r_rows[step], np.float32), np.asarray(g_rows[step], np.float32), int(g_tok[step])


def judge_structure(
    original: GreedyRun,
    twin: GreedyRun,
    arithmetic: str = "float32",
    *,
    accumulation: int = 1,
    layers: int = 1,
    separate: bool = True,
    reason: str = "",
    computed: int = 0,
    stored: str = "float16",
) -> StructureResult:
    """``twin``'s logits against ``original``'s within :func:`ortpa.tolerances.structure_bound` for a model whose
    longest dot product is ``accumulation`` long, over ``layers`` attention layers (``computed``, ``stored``:
    :func:`ortpa.tolerances.structure_tolerance`)."""
    tol = structure_tolerance(arithmetic, accumulation, layers, computed, stored)
    worst_abs = worst_rel = 0.0
    first = None
    for p, step, ref, got, _ in _pairs(original, twin):
        d = float(np.abs(got - ref).max())
        rel = d / max(1.0, float(np.abs(ref).max()))  # the row's scale, as ortpa.tolerances.structure_bound
        worst_abs, worst_rel = max(worst_abs, d), max(worst_rel, rel)
        if first is None and not rel <= tol:  # NaN fails
            first = (p, step)
    return StructureResult(first is None, arithmetic, separate, worst_abs, worst_rel, tol, first, reason)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def kl_divergence(reference: np.ndarray, other: np.ndarray) -> float:
    """KL(softmax(reference) || softmax(other)) of two logits rows, in nats (inf where not finite)."""
    lp, lq = _log_softmax(reference), _log_softmax(other)
    kl = float(np.sum(np.exp(lp) * (lp - lq)))
    return kl if np.isfinite(kl) else float("inf")


def judge_precision(
    original: GreedyRun,
    deployed: GreedyRun,
    dtype: str,
    routing_ties: Collection[tuple[int, int]] = (),
    *,
    cap_ties: bool = True,
) -> PrecisionResult:
    """``deployed`` against ``original``: token agreement under :func:`ortpa.tolerances.precision_ties`, top-k
    overlap, and KL(original || deployed) of each step's next-token distribution. ``routing_ties``: (prompt,
    step) pairs where a router's near-tie chose other experts (:mod:`ortpa.parity.routing`): reported, not
    judged, and counted with the token ties against :func:`ortpa.tolerances.max_tie_flips` (unless not
    ``cap_ties``: see :attr:`PrecisionResult.ties_capped`)."""
    ties_rule = precision_ties(dtype)
    kl_bound = precision_kl_bound(dtype)
    checked = agree = ties = mismatches = 0
    kls: list[float] = []
    overlaps: list[float] = []
    worst = 0.0
    k = PRECISION_TOP_K
    excused: list[tuple[int, int]] = []
    excused_kl = 0.0
    for p, step, ref, got, token in _pairs(original, deployed):
        if (p, step) in routing_ties:
            excused.append((p, step))
            excused_kl = max(excused_kl, kl_divergence(ref, got))
            continue
        checked += 1
        verdict = ties_rule.classify(ref, token)
        agree += verdict == "exact"
        ties += verdict == "tie"
        mismatches += verdict == "mismatch"
        kls.append(kl_divergence(ref, got))
        kk = min(k, ref.size)
        top_ref, top_got = set(np.argsort(-ref)[:kk].tolist()), set(np.argsort(-got)[:kk].tolist())
        overlaps.append(len(top_ref & top_got) / kk)
        d = float(np.abs(got - ref).max())
        worst = max(worst, d if np.isfinite(d) else float("inf"))
    allowed = max_tie_flips(checked + len(excused))
    kl_max = max(kls, default=0.0)
    capped_ok = ties + len(excused) <= allowed or not cap_ties
    ok = checked > 0 and mismatches == 0 and capped_ok and kl_max <= kl_bound
    return PrecisionResult(
        ok,
        dtype,
        checked,
        agree,
        ties,
        mismatches,
        allowed,
        kl_max,
        float(np.mean(kls)) if kls else 0.0,
        kl_bound,
        k,
        min(overlaps, default=1.0),
        float(np.mean(overlaps)) if overlaps else 1.0,
        worst,
        precision_logit_bound(dtype),
        len(excused),
        tuple(excused),
        excused_kl,
        cap_ties,
    )


def judge(
    original: GreedyRun,
    deployed: GreedyRun,
    dtype: str,
    *,
    twin: GreedyRun | None = None,
    twin_original: GreedyRun | None = None,
    arithmetic: str = "float32",
    accumulation: int = 1,
    layers: int = 1,
    reason: str = "",
    computed: int = 0,
    stored: str = "float16",
    cap_ties: bool = True,
) -> Verdict:
    """Both verdicts: structure on ``twin`` (or on ``deployed`` at ``arithmetic``'s bound where there is no
    separate twin) against ``twin_original`` (the original's own float32 twin, where the original computes in a
    half type) or else ``original``; precision on ``deployed`` against ``original``."""
    structure = judge_structure(
        twin_original if twin_original is not None else original,
        twin if twin is not None else deployed,
        arithmetic,
        accumulation=accumulation,
        layers=layers,
        separate=twin is not None,
        reason=reason,
        computed=computed,
        stored=stored,
    )
    return Verdict(structure, judge_precision(original, deployed, dtype, cap_ties=cap_ties))
