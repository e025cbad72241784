"""RoPE scalings a paged model cannot represent, refused before anything is exported.

Dynamic NTK (``rope_type: "dynamic"``) recomputes RoPE's frequencies at run time: transformers'
``dynamic_frequency_update`` takes the longest position in the *batch* (``max(position_ids) + 1``), rescales the
base past ``original_max_position_embeddings`` and keeps the result in the module for later calls. A sequence's
queries are therefore rotated by frequencies that depend on the other sequences of its step and on the calls
before (its cached keys were rotated under older ones). Up to ``original_max_position_embeddings`` it is plain
RoPE; past it no per-position cos/sin table, nor any per-sequence paged model, is the same function, and the
original itself is not batch-invariant. torch.export refuses its data-dependent branch anyway.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ortpa.errors import UnsupportedModel

__all__ = ["refuse_unrepresentable_rope"]

# rope types whose frequencies depend on the batch at run time
_BATCH_DEPENDENT = {"dynamic": "dynamic NTK"}


def _rope_parameters(config: Any) -> Iterator[Mapping]:
    """Every RoPE parameter dict of ``config`` (transformers 5's ``rope_parameters``, per layer type or not;
    older ``rope_scaling``)."""
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)
        if not isinstance(value, Mapping):
            continue
        nested = [v for v in value.values() if isinstance(v, Mapping)]
        yield from nested or [value]


def refuse_unrepresentable_rope(config: Any, where: str) -> None:
    """Raise :class:`~ortpa.errors.UnsupportedModel` (``mixes_sequences``) for a RoPE scaling whose frequencies
    depend on the batch (see the module's docstring); ``where`` names the model."""
    for params in _rope_parameters(config):
        kind = params.get("rope_type") or params.get("type")
        if kind in _BATCH_DEPENDENT:
            raise UnsupportedModel(
                where,
                f"RoPE scaling {kind!r} ({_BATCH_DEPENDENT[kind]}) is not converted: its frequencies follow the "
                "longest position in the batch, so a sequence's tokens depend on the others in its step; use a "
                "static scaling (linear, yarn, llama3)",
                mixes_sequences=True,
            )
