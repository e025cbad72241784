"""Numerical bounds and the greedy-tie rule, stated once for ``convert``'s verification, ``ortpa parity``,
``ortpa demo`` and the tests. Nothing here is measured on a fixture: every bound follows from a dtype.

**The verification rule** keeps *structure* and *precision* apart (:mod:`ortpa.parity.rule`):

*Structure* is judged on the conversion's float32 twin (:mod:`ortpa.parity.twin`: the same rewrite with its
attention and caches in float32) against the original, logits row by row:
``|twin - original| <= structure_tolerance(arithmetic) * max(1, max |original row|)``, with
``structure_tolerance(a) = sqrt(u_a)``, ``u_a`` the unit roundoff of the coarsest arithmetic the two share
(:data:`UNIT_ROUNDOFF`; float32: 2^-24, so 2.4e-4 of the row's scale). Why: a float32 dot product of length
``n`` reordered moves by about ``sqrt(n) * u`` of its scale (2^-24 * 128 = 7.6e-6 for a 16k-wide row), and a
model of ``L`` such layers, each at most a few times that through the residual stream, stays below
``sqrt(u)`` = 2^-12 for any ``L * sqrt(n)`` up to 2^12 (60 layers of width 4k: 3.8e3): half of float32's
digits, whatever the size. A structural mistake (a scale off by 10 %, a RoPE base, a window off by one, a
softcap, two heads swapped, a sink, a norm epsilon, a shifted cache position) changes attention by a relative
1e-3 or more, i.e. the logits by orders of magnitude past it (:mod:`tests.test_defects` measures each). Where
the original itself computes coarser (float16 weights and activations; int8 activations of MatMulNBits
``accuracy_level=4``) or the converted model computes in T throughout (``dtype=``), that arithmetic's ``u``
replaces float32's: the bound is ``sqrt(u)`` of the coarsest arithmetic either model performs.

*Precision*, the deployed model's T (float16, bfloat16) or int8 cache, is measured against the original with
statistics that mean the same on any model: greedy agreement under the tie rule, top-k overlap and the KL
divergence of the next-token distributions. The stated bound: a logit perturbation of
``precision_logit_bound(T) = 2 * sqrt(u_T)`` nats (float16 0.044, bfloat16 0.125, int8 0.125), i.e. a
next-token distribution within ``KL <= precision_logit_bound(T)**2 / 2`` of the original's (KL of a
perturbation ``d`` is about ``Var_p(d) / 2 <= max |d|**2 / 2``), and greedy tokens that differ only at a tie:
where the original's gap between the two tokens is within ``2 * precision_logit_bound(T)``. The maximum
|dlogit| is reported, not judged: it grows with the vocabulary's tail, which KL weighs by its probability.
For scale, six real float16 conversions of 1-7B models measured max |dlogit| 0.0095-0.026 with identical
greedy tokens (issue 28), well inside; a wrong conversion is refused by the structure test first.

Greedy ties: if every logit of a row is within ``b`` of the reference row, the argmax can differ from the
reference's only where the reference's gap between the two tokens is at most ``2 * b``
(:data:`TIE_MARGIN_FACTOR`). Such a *tie flip* is a correct greedy choice within the precision, but it must stay
rare: at most :func:`max_tie_flips` of ``n`` checked tokens (one per :data:`TIE_FLIPS_PER`, at least one per
run). Every other differing token is a mismatch.

:data:`TOL` remains the element-wise bound of one op's output in its own dtype (kernels against the NumPy
oracle), where the accumulation is one op's and does not grow with a model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ortpa.dtypes import dtype_name

__all__ = [
    "EXPORT_ATOL",
    "PRECISION_TOP_K",
    "TIE_FLIPS_PER",
    "TIE_MARGIN_FACTOR",
    "TOL",
    "UNIT_ROUNDOFF",
    "TieBound",
    "max_tie_flips",
    "precision_kl_bound",
    "precision_logit_bound",
    "precision_ties",
    "structure_bound",
    "structure_tolerance",
    "tie_bound",
    "tol_for",
    "unit_roundoff",
]

# (rtol, atol) per activation dtype name.
TOL: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 5e-3),
    "bfloat16": (2e-2, 2e-2),
}

# A float32 ONNX export against the PyTorch model it came from, logits, absolute: the bar (measured on the
# MLA fixtures: 2e-6 to 6e-6, i.e. reordered float32 sums; a wrong RoPE or routing is off by O(1)).
EXPORT_ATOL = 1e-4

# Unit roundoff (half an ulp at 1) of each arithmetic; "int8": half a step of a symmetric 127-level scale.
UNIT_ROUNDOFF: dict[str, float] = {
    "float32": 2.0**-24,
    "float16": 2.0**-11,
    "bfloat16": 2.0**-8,
    "float8e4m3fn": 2.0**-4,
    "int8": 1.0 / 254.0,
}
# top-k overlap of the next-token distributions: reported with the precision statistics
PRECISION_TOP_K = 5

# Two rows each within b of the truth rank two tokens differently only if the truth's gap is <= 2 b.
TIE_MARGIN_FACTOR = 2.0
# At most one tie flip per this many checked tokens (and at least one allowed per run).
TIE_FLIPS_PER = 100


def tol_for(dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for activations of ``dtype`` (a NumPy dtype, ``ml_dtypes.bfloat16`` or its name)."""
    name = dtype_name(dtype)
    if name not in TOL:
        raise KeyError(f"no tolerance for dtype {name!r}; have {sorted(TOL)}")
    return TOL[name]


def max_tie_flips(checked_tokens: int) -> int:
    """How many of ``checked_tokens`` greedy picks may be tie flips."""
    return max(1, checked_tokens // TIE_FLIPS_PER)


@dataclass(frozen=True)
class TieBound:
    """The greedy-tie rule for one comparison: ``rtol``/``atol`` of the logits, from :func:`tie_bound`."""

    rtol: float
    atol: float

    def margin(self, dense_row: np.ndarray) -> float:
        """The largest dense gap (max logit - picked token's logit) that is still a tie for this row."""
        top = float(np.max(np.asarray(dense_row, np.float32)))
        return TIE_MARGIN_FACTOR * (self.atol + self.rtol * abs(top))

    def classify(self, dense_row: np.ndarray, token: int) -> str:
        """``"exact"`` (the dense argmax), ``"tie"`` (within :meth:`margin` of it) or ``"mismatch"``."""
        row = np.asarray(dense_row, np.float32)
        if token == int(row.argmax()):
            return "exact"
        return "tie" if float(row.max() - row[token]) <= self.margin(row) else "mismatch"


def tie_bound(dtype="float16", extra_atol: float = 0.0) -> TieBound:
    """The tie rule for logits of activation ``dtype`` compared within ``tol_for(dtype)`` plus ``extra_atol``."""
    rtol, atol = tol_for(dtype)
    return TieBound(rtol, atol + extra_atol)


def unit_roundoff(dtype) -> float:
    """:data:`UNIT_ROUNDOFF` of ``dtype`` (a name, a NumPy dtype, ``ml_dtypes.bfloat16`` or an ONNX type)."""
    name = dtype if dtype == "int8" else dtype_name(dtype)
    if name not in UNIT_ROUNDOFF:
        raise KeyError(f"no unit roundoff for dtype {name!r}; have {sorted(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[name]


def structure_tolerance(arithmetic="float32") -> float:
    """The structure bound relative to a row's scale: ``sqrt(u)`` of the coarsest shared ``arithmetic``."""
    return float(np.sqrt(unit_roundoff(arithmetic)))


def structure_bound(reference: np.ndarray, arithmetic="float32") -> np.ndarray:
    """Per row of ``reference`` (``[..., width]``): the largest allowed ``|twin - reference|``, i.e.
    :func:`structure_tolerance` times the row's scale ``max(1, max |row|)`` (shape ``[..., 1]``)."""
    ref = np.asarray(reference, np.float32)
    scale = np.maximum(1.0, np.abs(ref).max(axis=-1, keepdims=True))
    return structure_tolerance(arithmetic) * scale


def precision_logit_bound(dtype) -> float:
    """The logit perturbation (nats) the deployed precision ``dtype`` may cost: ``2 * sqrt(u)``."""
    return 2.0 * float(np.sqrt(unit_roundoff(dtype)))


def precision_kl_bound(dtype) -> float:
    """The largest next-token KL divergence (nats) the deployed precision may cost: ``bound**2 / 2``."""
    return precision_logit_bound(dtype) ** 2 / 2.0


def precision_ties(dtype) -> TieBound:
    """The greedy-tie rule of the deployed precision: ties within ``2 * precision_logit_bound(dtype)``."""
    return TieBound(0.0, precision_logit_bound(dtype))
