"""Moved to :mod:`ortpa.testing.checkpoints` (the sweep writes checkpoints too); kept for branches that import it."""

from __future__ import annotations

from ortpa.testing.checkpoints import (
    _dequantize,
    fp8_reference_folder,
    is_fp8_weight,
    save_checkpoint,
    save_fp8_checkpoint,
)

__all__ = ["_dequantize", "fp8_reference_folder", "is_fp8_weight", "save_checkpoint", "save_fp8_checkpoint"]
