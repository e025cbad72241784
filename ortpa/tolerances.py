"""Numerical tolerances and the greedy-tie rule, stated once for tests, ``ortpa parity`` and ``ortpa demo``.

Logits of a paged model are compared with the dense original's in float32, element by element, within
``atol + rtol * |dense|`` where ``(rtol, atol)`` follow the activation (cache) dtype: fp16 ~1e-3 relative
(5e-3 absolute on unit-scale logits), bf16 ~1e-2 (8-bit mantissa). Model families whose attention sees larger
activations, and int8 caches, add an absolute term measured on the fixtures (below).

Greedy ties: if every logit of the paged row is within the bound ``b`` of the dense row, the paged argmax can
differ from the dense argmax only where the dense gap between the two tokens is at most ``2 * b``
(:data:`TIE_MARGIN_FACTOR`). Such a *tie flip* is a correct greedy choice within the precision of the op, but
it must stay rare: at most :func:`max_tie_flips` of ``n`` checked tokens (one per :data:`TIE_FLIPS_PER`, at
least one per run). Every other differing token is a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = [
    "ACT_INT8_EXTRA_ATOL",
    "EXPORT_ATOL",
    "FAMILY_EXTRA_ATOL",
    "FP16_WEIGHTS_EXTRA_ATOL",
    "KV_INT8_EXTRA_ATOL",
    "SOURCE_INT4_EXTRA_ATOL",
    "TIE_FLIPS_PER",
    "TIE_MARGIN_FACTOR",
    "TOL",
    "TieBound",
    "logit_tolerance",
    "logprob_bound",
    "max_tie_flips",
    "tie_bound",
    "tol_for",
]

# (rtol, atol) per activation dtype name.
TOL: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 5e-3),
    "bfloat16": (2e-2, 2e-2),
}

# Extra absolute tolerance on logits for model families whose attention sees larger activations, so float16
# rounding of q/k/v inside PagedAttention costs more: Gemma-2 ((1 + w) RMSNorm weights, sqrt(hidden) embedding
# scale, softcapped scores) measured 9.1e-3 max over 24 tokens with errors flat across steps (no drift).
FAMILY_EXTRA_ATOL: dict[str, float] = {"gemma2": 5e-3, "gemma2-genai": 3.5e-2, "gptoss-genai": 7.5e-3}
# "gemma2-genai": the onnxruntime-genai builder's Gemma-2 (softcap 50, sliding window 8 over a ring-buffer cache,
# fp32 activations around float16 attention) measured 2.9e-2 max over 24 tokens, the larger errors on decode steps
# past the window; windows of 7 or 9 instead of 8 fail by > 0.1 at the first step past the window, so the window
# carried over is the right one and the rest is float16 rounding of Gemma's larger activations.
# "gptoss-genai": the builder's gpt-oss (attention sinks, sliding window 8 on even layers, MoE with swiglu_limit 7,
# fp32 around float16 attention) measured 8.4e-3 max over 24 tokens (prompts 5/20/9), per-step errors flat
# (2.4e-3..8.4e-3, no drift); without the sinks the error is 1.4 (tests/rewriter/test_genai_gptoss.py).

# Extra absolute tolerance on logits for int8 KV caches (ortpa.rewriter.kv_quant, calibrated static scales).
# One quantization step is s = amax * 1.25 / 127; the fixtures' cached K/V reach |x| ~ 3.3-3.9, so a stored
# element is off by up to s/2 ~ 0.016-0.02. Measured max |dlogit| over the parity driver's 24 tokens:
# per-channel 0.079 (dsv3 MLA) / 0.077 (llama GQA), per-tensor 0.108 / 0.095 (float16 caches: 2.4e-3 / 2.8e-3),
# i.e. 4-6 half-steps; 0.15 leaves ~1.4x headroom over the worst, while scales 10x / 100x off give 0.86-1.06 /
# 3.7-5.9 (tests/rewriter/test_kv_quant.py::test_scales_matter).
KV_INT8_EXTRA_ATOL = 0.15

# Extra absolute tolerance on logits for models whose projections quantize their *activations* to int8
# (onnxruntime-genai int4: MatMulNBits accuracy_level=4). The converted model runs attention in float16, so the
# input of o_proj moves by ~1e-3 relative; where an element sits near an int8 rounding boundary it moves by a
# whole step (amax/127), which the following layers carry to the logits. The original itself is exact across
# batching (same rows, same result), so this is the cost of the float16 attention, not of batching. Measured
# max |dlogit| over the parity driver's 24 tokens: 0.059 (Llama) / 0.086 (Qwen3); 0.12 leaves ~1.4x headroom.
ACT_INT8_EXTRA_ATOL = 0.12

# The source-quantisation term of ``ortpa parity`` for an int4 original (MatMulNBits): the converted model's
# float16 cache / attention (TOL["float16"]) plus the activation int8 rounding flips above, plus the 0.05 measured
# on the CLI's default prompts with the float16 cache of the converted model (the int4 CLI parity test measured
# up to 0.057 over ACT_INT8 headroom's base; it carried this as an ad-hoc --atol before).
SOURCE_INT4_EXTRA_ATOL = 0.05 + ACT_INT8_EXTRA_ATOL

# Extra absolute tolerance on logits when a whole model built with float16 weights and activations (the
# onnxruntime-genai fp16 builds) is compared with its float32 build of the same weights: weight rounding adds to
# the float16 activation error at every layer. Measured max |dlogit| over test_formats' 12 greedy steps: 7.7e-3
# (Llama) / 5.8e-3 (Qwen3); 1e-2 on top of TOL["float16"] leaves ~1.5x headroom.
FP16_WEIGHTS_EXTRA_ATOL = 1e-2

# A float32 ONNX export against the PyTorch model it came from, logits, absolute: the bar (measured on the
# MLA fixtures: 2e-6 to 6e-6, i.e. reordered float32 sums; a wrong RoPE or routing is off by O(1)).
EXPORT_ATOL = 1e-4

# Two rows each within b of the truth rank two tokens differently only if the truth's gap is <= 2 b.
TIE_MARGIN_FACTOR = 2.0
# At most one tie flip per this many checked tokens (and at least one allowed per run).
TIE_FLIPS_PER = 100


def tol_for(dtype) -> tuple[float, float]:
    """``(rtol, atol)`` for activations of ``dtype`` (a NumPy dtype, ``ml_dtypes.bfloat16`` or its name)."""
    from ortpa.dtypes import dtype_name  # here: onnx_ir is no import of the CLI's start (--family's choices)

    name = dtype_name(dtype)
    if name not in TOL:
        raise KeyError(f"no tolerance for dtype {name!r}; have {sorted(TOL)}")
    return TOL[name]


def logprob_bound(reference_logits, cache_dtype: str = "float16", family: str | None = None) -> float:
    """Absolute bound on log-probabilities whose logits rows are each within :func:`logit_tolerance` of
    ``reference_logits``: ``log_softmax(x)_i = x_i - logsumexp(x)`` and logsumexp moves by at most the largest
    logit error, so a log-probability moves by at most twice the largest bound ``atol + rtol * |x|`` of the row.
    Used for prompt and token log-probabilities (``ortpa serve``'s ``logprobs``, lm-evaluation-harness)."""
    rtol, atol = logit_tolerance(cache_dtype, family)
    return 2.0 * (atol + rtol * float(np.max(np.abs(np.asarray(reference_logits, dtype=np.float64)))))


def logit_tolerance(
    cache_dtype: str = "float16", family: str | None = None, *, source_int4: bool = False
) -> tuple[float, float]:
    """``(rtol, atol)`` on logits for a paged model whose caches are ``cache_dtype`` (``"int8"``: fp16 compute
    plus :data:`KV_INT8_EXTRA_ATOL`), plus :data:`FAMILY_EXTRA_ATOL` for ``family`` where measured, plus
    :data:`SOURCE_INT4_EXTRA_ATOL` when the original quantizes its weights to int4 (``source_int4``)."""
    if cache_dtype == "int8":
        rtol, atol = TOL["float16"]
        atol += KV_INT8_EXTRA_ATOL
    else:
        rtol, atol = tol_for(cache_dtype)
    source = SOURCE_INT4_EXTRA_ATOL if source_int4 else 0.0
    return rtol, atol + FAMILY_EXTRA_ATOL.get(family or "", 0.0) + source


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
