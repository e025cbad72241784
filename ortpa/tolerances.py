"""Numerical bounds and the greedy-tie rule, stated once for ``convert``'s verification, ``ortpa parity``,
``ortpa demo`` and the tests. Nothing here is measured on a fixture: every bound follows from a dtype.

**The verification rule** keeps *structure* and *precision* apart (:mod:`ortpa.parity.rule`):

*Structure* is judged on the conversion's float32 twin (:mod:`ortpa.parity.twin`: the same rewrite with its
attention and caches in float32) against the original, logits row by row:
``|twin - original| <= structure_tolerance(a, n, L) * max(1, max |original row|)`` with
``structure_tolerance(a, n, L) = STRUCTURE_HEADROOM * u_a * sqrt(n * L)``: ``u_a`` the unit roundoff of the
coarsest arithmetic the two share (:data:`UNIT_ROUNDOFF`; float32: 2^-24), ``n`` the model's longest dot
product (its widest MatMul's contracted dimension), ``L`` its attention layers. Why: a sum of ``n`` products
each rounded by a relative ``u`` moves by about ``u * sqrt(n)`` of its scale when its order changes (independent
roundings add in quadrature); every layer adds such errors to the residual stream, ``L`` layers
``sqrt(L)`` times one; a layer holds a handful of sums (projections, MLP, scores, weighted values) and norms that
may amplify them a few times, which :data:`STRUCTURE_HEADROOM` (16, four bits) covers. A 2-layer fixture with a
128-wide MLP gets 1.5e-5 of its logits' scale (its twin measures 5e-7 to 1e-6), a 60-layer model with a 14k-wide
MLP 8.8e-4. The bound follows the model's arithmetic, not its family, and scales with its sums as the rounding does.
A structural mistake (a scale off by 10 %, a RoPE base, a window off by one, a softcap, two heads swapped, a
sink, a shifted cache position) moves the logits by 1e-2 to 1 of their scale, orders of magnitude past it; the
smallest defects, a norm epsilon x100 (5e-5 of a unit-RMS activation) or a scale off by 0.1 %, are caught on
small models and fall under float32's own noise on deep ones (tests/test_defects.py, docs/verification.md
measure the margin). An original that computes in float16 itself is compared through float32 twins of both
sides, at float32's ``u``; weights its conversion computed and stored rounded to T without a recipe the twins can
rebuild them from (:mod:`ortpa.parity.products`: MLA's absorbed projections have one) add one rounding each:
``STRUCTURE_HEADROOM * sqrt(L * (u**2 * n + u_T**2 * k))`` for ``k`` of them per layer.
Where the original quantizes activations (int8 of MatMulNBits ``accuracy_level=4``) or the converted model
computes in T and its original does not (``dtype=``), that arithmetic's ``u`` replaces float32's; the structure
bound then says little and precision decides.

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

Routing ties: a mixture-of-experts router ranks experts by scores computed from the same hidden state the logits
are, perturbed by the same deployed precision; two scores within ``2 * precision_logit_bound(T)`` of each other
(:func:`routing_tie_width`, the tie rule applied to the router's score row) may swap, and the deployed model then
mixes other experts for that token. Such a step is a *routing tie*: its statistics are reported, not judged, and
it counts against the same :func:`max_tie_flips` allowance as a greedy tie flip (:mod:`ortpa.parity.routing`).

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

__all__ = [
    "EXPORT_ATOL",
    "PRECISION_TOP_K",
    "STRUCTURE_HEADROOM",
    "TIE_FLIPS_PER",
    "TIE_MARGIN_FACTOR",
    "TOL",
    "UNIT_ROUNDOFF",
    "TieBound",
    "logprob_bound",
    "max_tie_flips",
    "precision_kl_bound",
    "precision_logit_bound",
    "precision_ties",
    "routing_tie_width",
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
# Rounding errors of the few sums in a layer (q/k/v/o projections, the MLP, scores, weighted values: ~8, so
# sqrt(8) ~ 3) carried through its norms (a few times): 16 = 4 bits of headroom over u * sqrt(n * L).
STRUCTURE_HEADROOM = 16.0
# top-k overlap of the next-token distributions: reported with the precision statistics
PRECISION_TOP_K = 5

# Two rows each within b of the truth rank two tokens differently only if the truth's gap is <= 2 b.
TIE_MARGIN_FACTOR = 2.0
# At most one tie flip per this many checked tokens (and at least one allowed per run).
TIE_FLIPS_PER = 100


def tol_for(dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for activations of ``dtype`` (a NumPy dtype, ``ml_dtypes.bfloat16`` or its name)."""
    from ortpa.dtypes import dtype_name  # here: onnx_ir is no import of the CLI's start

    name = dtype_name(dtype)
    if name not in TOL:
        raise KeyError(f"no tolerance for dtype {name!r}; have {sorted(TOL)}")
    return TOL[name]


def logprob_bound(cache_dtype="float16") -> float:
    """Absolute bound on a log-probability of a model whose logits each move by at most
    :func:`precision_logit_bound` of ``cache_dtype`` (the precision rule): ``log_softmax(x)_i = x_i -
    logsumexp(x)`` and logsumexp moves by at most the largest logit error, so twice that bound. Used for prompt
    and token log-probabilities (``ortpa serve``'s ``logprobs``, lm-evaluation-harness)."""
    return 2.0 * precision_logit_bound(cache_dtype)


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
    from ortpa.dtypes import dtype_name  # here: onnx_ir is no import of the CLI's start

    name = dtype if dtype == "int8" else dtype_name(dtype)
    if name not in UNIT_ROUNDOFF:
        raise KeyError(f"no unit roundoff for dtype {name!r}; have {sorted(UNIT_ROUNDOFF)}")
    return UNIT_ROUNDOFF[name]


def structure_tolerance(
    arithmetic="float32", accumulation: int = 1, layers: int = 1, computed: int = 0, stored="float16"
) -> float:
    """The structure bound relative to a row's scale: ``STRUCTURE_HEADROOM * u * sqrt(accumulation * layers)``
    for the coarsest shared ``arithmetic``, the model's longest dot product ``accumulation`` and its number of
    attention ``layers``. ``computed``: weights per layer the conversion computed from the original's (MLA's
    absorbed projections, ``W_q @ W_uk``, where no recipe rebuilds them: :mod:`ortpa.parity.products`) and stored
    rounded to ``stored``, which no float32 twin can unround:
    each moves the activation it makes by about ``u_stored`` of its scale (one rounding per weight element,
    not a sum's), so the bound is ``STRUCTURE_HEADROOM * sqrt(layers * (u**2 * accumulation + u_stored**2 *
    computed))``."""
    variance = unit_roundoff(arithmetic) ** 2 * max(1, accumulation)
    if computed:
        variance += unit_roundoff(stored) ** 2 * computed
    return STRUCTURE_HEADROOM * float(np.sqrt(max(1, layers) * variance))


def structure_bound(reference: np.ndarray, arithmetic="float32", accumulation: int = 1, layers: int = 1):
    """Per row of ``reference`` (``[..., width]``): the largest allowed ``|twin - reference|``, i.e.
    :func:`structure_tolerance` times the row's scale ``max(1, max |row|)`` (shape ``[..., 1]``)."""
    ref = np.asarray(reference, np.float32)
    scale = np.maximum(1.0, np.abs(ref).max(axis=-1, keepdims=True))
    return structure_tolerance(arithmetic, accumulation, layers) * scale


def precision_logit_bound(dtype) -> float:
    """The logit perturbation (nats) the deployed precision ``dtype`` may cost: ``2 * sqrt(u)``."""
    return 2.0 * float(np.sqrt(unit_roundoff(dtype)))


def precision_kl_bound(dtype) -> float:
    """The largest next-token KL divergence (nats) the deployed precision may cost: ``bound**2 / 2``."""
    return precision_logit_bound(dtype) ** 2 / 2.0


def routing_tie_width(dtype, scores_row: np.ndarray) -> float:
    """The largest gap between a router's k-th and (k+1)-th score (``scores_row``, the original's) at which the
    deployed precision ``dtype`` may swap the two experts: the greedy-tie rule's margin on that row."""
    return precision_ties(dtype).margin(scores_row)


def precision_ties(dtype) -> TieBound:
    """The greedy-tie rule of the deployed precision: ties within ``2 * precision_logit_bound(dtype)``."""
    return TieBound(0.0, precision_logit_bound(dtype))
