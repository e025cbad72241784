"""The suite's view of :mod:`ortpa.tolerances` (the one table, shared with ``ortpa parity`` and ``ortpa demo``),
plus :func:`assert_close`, which compares with it."""

from __future__ import annotations

import numpy as np

from ortpa.tolerances import (
    ACT_INT8_EXTRA_ATOL,
    EXPORT_ATOL,
    FAMILY_EXTRA_ATOL,
    FP16_WEIGHTS_EXTRA_ATOL,
    KV_INT8_EXTRA_ATOL,
    TOL,
    TieBound,
    logit_tolerance,
    max_tie_flips,
    tie_bound,
    tol_for,
)

__all__ = [
    "ACT_INT8_EXTRA_ATOL",
    "EXPORT_ATOL",
    "FAMILY_EXTRA_ATOL",
    "FP16_WEIGHTS_EXTRA_ATOL",
    "KV_INT8_EXTRA_ATOL",
    "TOL",
    "TieBound",
    "assert_close",
    "logit_tolerance",
    "max_tie_flips",
    "tie_bound",
    "tol_for",
]


def assert_close(actual, expected, dtype, *, what: str = "", extra_atol: float = 0.0) -> None:
    """Compare in float32 with the tolerance of ``dtype``; the message names ``what`` and the worst element."""
    rtol, atol = tol_for(dtype)
    a = np.asarray(actual, dtype=np.float32)
    e = np.asarray(expected, dtype=np.float32)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol + extra_atol, err_msg=what)
