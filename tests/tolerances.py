"""Numerical tolerances, stated once for the whole suite, by activation dtype.

fp16 ~1e-3 relative (the op's own tests use 5e-3 absolute on unit-scale data), bf16 ~1e-2 (8-bit mantissa).
Quantized caches are compared within one quantization step, computed from the scale at the call site.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "ACT_INT8_EXTRA_ATOL",
    "EXPORT_ATOL",
    "FAMILY_EXTRA_ATOL",
    "FP16_WEIGHTS_EXTRA_ATOL",
    "KV_INT8_EXTRA_ATOL",
    "TOL",
    "assert_close",
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
FAMILY_EXTRA_ATOL: dict[str, float] = {"gemma2": 5e-3, "gemma2-genai": 3.5e-2}
# "gemma2-genai": the onnxruntime-genai builder's Gemma-2 (softcap 50, sliding window 8 over a ring-buffer cache,
# fp32 activations around float16 attention) measured 2.9e-2 max over 24 tokens, the larger errors on decode steps
# past the window; windows of 7 or 9 instead of 8 fail by > 0.1 at the first step past the window, so the window
# carried over is the right one and the rest is float16 rounding of Gemma's larger activations.

# Extra absolute tolerance on logits for int8 KV caches (ortpa.rewriter.kv_quant, calibrated static scales).
# One quantization step is s = amax * 1.25 / 127; the fixtures' cached K/V reach |x| ~ 3.3-3.9, so a stored
# element is off by up to s/2 ~ 0.016-0.02. Measured max |dlogit| over parity.run_parity's 24 tokens:
# per-channel 0.079 (dsv3 MLA) / 0.077 (llama GQA), per-tensor 0.108 / 0.095 (float16 caches: 2.4e-3 / 2.8e-3),
# i.e. 4-6 half-steps; 0.15 leaves ~1.4x headroom over the worst, while scales 10x / 100x off give 0.86-1.06 /
# 3.7-5.9 (test_kv_quant::test_scales_matter).
KV_INT8_EXTRA_ATOL = 0.15

# Extra absolute tolerance on logits for models whose projections quantize their *activations* to int8
# (onnxruntime-genai int4: MatMulNBits accuracy_level=4). The converted model runs attention in float16, so the
# input of o_proj moves by ~1e-3 relative; where an element sits near an int8 rounding boundary it moves by a
# whole step (amax/127), which the following layers carry to the logits. The original itself is exact across
# batching (same rows, same result), so this is the cost of the float16 attention, not of batching. Measured
# max |dlogit| over parity.run_parity's 24 tokens: 0.059 (Llama) / 0.086 (Qwen3); 0.12 leaves ~1.4x headroom.
ACT_INT8_EXTRA_ATOL = 0.12

# Extra absolute tolerance on logits when a whole model built with float16 weights and activations (the
# onnxruntime-genai fp16 builds) is compared with its float32 build of the same weights: weight rounding adds to
# the float16 activation error at every layer. Measured max |dlogit| over test_formats' 12 greedy steps: 7.7e-3
# (Llama) / 5.8e-3 (Qwen3); 1e-2 on top of TOL["float16"] leaves ~1.5x headroom.
FP16_WEIGHTS_EXTRA_ATOL = 1e-2

# A float32 ONNX export against the PyTorch model it came from, logits, absolute: the bar (measured on the
# MLA fixtures: 2e-6 to 6e-6, i.e. reordered float32 sums; a wrong RoPE or routing is off by O(1)).
EXPORT_ATOL = 1e-4


def tol_for(dtype) -> tuple[float, float]:
    name = np.dtype(dtype).name if np.dtype(dtype) != np.dtype(ml_dtypes.bfloat16) else "bfloat16"
    return TOL[name]


def assert_close(actual, expected, dtype, *, what: str = "", extra_atol: float = 0.0) -> None:
    """Compare in float32 with the tolerance of ``dtype``; the message names ``what`` and the worst element."""
    rtol, atol = tol_for(dtype)
    a = np.asarray(actual, dtype=np.float32)
    e = np.asarray(expected, dtype=np.float32)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol + extra_atol, err_msg=what)
