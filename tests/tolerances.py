"""Numerical tolerances, stated once for the whole suite, by activation dtype.

fp16 ~1e-3 relative (the op's own tests use 5e-3 absolute on unit-scale data), bf16 ~1e-2 (8-bit mantissa).
Quantized caches are compared within one quantization step, computed from the scale at the call site.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["FAMILY_EXTRA_ATOL", "TOL", "assert_close", "tol_for"]

# (rtol, atol) per activation dtype name.
TOL: dict[str, tuple[float, float]] = {
    "float32": (1e-5, 1e-5),
    "float16": (2e-3, 5e-3),
    "bfloat16": (2e-2, 2e-2),
}


# Extra absolute tolerance on logits for model families whose attention sees larger activations, so float16
# rounding of q/k/v inside PagedAttention costs more: Gemma-2 ((1 + w) RMSNorm weights, sqrt(hidden) embedding
# scale, softcapped scores) measured 9.1e-3 max over 24 tokens with errors flat across steps (no drift).
FAMILY_EXTRA_ATOL: dict[str, float] = {"gemma2": 5e-3}


def tol_for(dtype) -> tuple[float, float]:
    name = np.dtype(dtype).name if np.dtype(dtype) != np.dtype(ml_dtypes.bfloat16) else "bfloat16"
    return TOL[name]


def assert_close(actual, expected, dtype, *, what: str = "", extra_atol: float = 0.0) -> None:
    """Compare in float32 with the tolerance of ``dtype``; the message names ``what`` and the worst element."""
    rtol, atol = tol_for(dtype)
    a = np.asarray(actual, dtype=np.float32)
    e = np.asarray(expected, dtype=np.float32)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol + extra_atol, err_msg=what)
