"""Batched = alone: values a packed graph computes over the whole step -> what each sequence computes alone, or a
refusal naming the node.

``reductions`` runs the pass (choices, cache positions, LongRoPE table choices in ``rope_choice``), ``flow`` the
dataflow over kinds (``kinds``, ``layout``, ``axes``), ``segments`` its segment rewrites, ``choice`` the rewrite of
a step-wide boolean choice into a per-token one.
"""

from ortpa.rewriter.per_sequence.reductions import TOKEN_REDUCTIONS, per_sequence_reductions

__all__ = ["TOKEN_REDUCTIONS", "per_sequence_reductions"]
