"""The suite's view of :mod:`ortpa.tolerances` (the one rule, shared with ``convert``, ``ortpa parity`` and
``ortpa demo``), plus :func:`assert_close`, which compares one op's output with :data:`TOL`. Where a test compares
whole models element-wise, its allowance is the precision rule's logit bound of the coarsest dtype involved
(:func:`precision_logit_bound`), never a constant measured on a fixture."""

from __future__ import annotations

import numpy as np

from ortpa.tolerances import (
    EXPORT_ATOL,
    TOL,
    TieBound,
    max_tie_flips,
    precision_kl_bound,
    precision_logit_bound,
    precision_ties,
    structure_tolerance,
    tie_bound,
    tol_for,
)

__all__ = [
    "EXPORT_ATOL",
    "TOL",
    "TieBound",
    "assert_close",
    "max_tie_flips",
    "precision_kl_bound",
    "precision_logit_bound",
    "precision_ties",
    "structure_tolerance",
    "tie_bound",
    "tol_for",
]


def assert_close(actual, expected, dtype, *, what: str = "", extra_atol: float = 0.0) -> None:
    """Compare in float32 with the tolerance of ``dtype``; the message names ``what`` and the worst element."""
    rtol, atol = tol_for(dtype)
    a = np.asarray(actual, dtype=np.float32)
    e = np.asarray(expected, dtype=np.float32)
    np.testing.assert_allclose(a, e, rtol=rtol, atol=atol + extra_atol, err_msg=what)
