"""The product's parity check: a converted model against its original, run alone in its own format.

:mod:`~ortpa.parity.greedy` holds the greedy loops (the dense original one prompt at a time, the paged model
batched) that record each step's logits; ``ortpa parity``, ``ortpa demo`` and the tests compare them with the
one tolerance table, :mod:`ortpa.tolerances`.
"""

from __future__ import annotations

from ortpa.parity.check import ParityResult, StepReport, compare_runs, default_prompts
from ortpa.parity.greedy import DenseModel, GreedyRun, dense_forward, dense_greedy, open_dense, paged_greedy

__all__ = [
    "DenseModel",
    "GreedyRun",
    "ParityResult",
    "StepReport",
    "compare_runs",
    "default_prompts",
    "dense_forward",
    "dense_greedy",
    "open_dense",
    "paged_greedy",
]
