"""Which dtype a checkpoint exports in when none is asked for, and the float16 range check that choice needs.

A bfloat16 or FP8 checkpoint exports as float16: ONNX Runtime's CPU kernels have no bfloat16 arithmetic, and
float16 runs on CPU (portable path) and on CUDA at the 2 bytes a weight bfloat16 takes. float16's range is
narrower than bfloat16's, so a weight past 65504 (inf once cast) is refused by name; a forward that overflows is
refused by :func:`ortpa.export.hf.export_hf`. Other stored dtypes export as stored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ortpa.errors import ConversionError

__all__ = ["WIDER", "check_float16_range", "default_export_dtype", "refuse_cpu_bfloat16", "stored_dtype"]

_DTYPES = ("float32", "float16", "bfloat16")
# what to pass when float16 is too narrow
WIDER = (
    "export in float32 (--export-dtype float32) or, for CUDA only, bfloat16 (--export-dtype bfloat16 --providers cuda)"
)


def stored_dtype(folder: str | os.PathLike) -> str:
    """How a checkpoint folder stores its weights: ``fp8`` (``quantization_config`` of ``quant_method: fp8``),
    else its config's ``torch_dtype`` / ``dtype`` (``float32`` when it names none)."""
    path = Path(folder)
    path = path.parent if path.is_file() else path
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    if (config.get("quantization_config") or {}).get("quant_method") == "fp8":
        return "fp8"
    stored = config.get("torch_dtype") or config.get("dtype") or "float32"
    return str(stored).removeprefix("torch.")


# What each stored dtype exports as when no dtype is asked for: a model that ONNX Runtime runs on CPU (portable
# path; its CPU kernels lack bfloat16 arithmetic) and on CUDA, in the checkpoint's own 2 bytes per weight for
# bfloat16. FP8 is dequantized in float32 and rounded once (2 bytes per weight, twice the FP8 checkpoint).
_DEFAULT_EXPORT_DTYPE = {"bfloat16": "float16", "fp8": "float16"}


def default_export_dtype(stored: str, requested: str | None = None) -> str:
    """The export's dtype: ``requested``, else float16 for a bfloat16 or FP8 checkpoint, else as stored."""
    if requested is not None:
        return requested
    return _DEFAULT_EXPORT_DTYPE.get(stored, stored if stored in _DTYPES else "float32")


def check_float16_range(model, label: str, stored: str) -> None:
    """A weight past float16's range became inf when cast: refuse, naming it, rather than export garbage."""
    import torch

    from ortpa.errors import InvalidModel

    for name, p in model.named_parameters():
        if not bool(torch.isfinite(p).all()):
            raise InvalidModel(
                label,
                f"weight {name} does not fit float16 (its {stored} values pass 65504); {WIDER}",
            )


def refuse_cpu_bfloat16(label: str, export_dtype: str, providers: tuple[str, ...]) -> None:
    """Before any export: a bfloat16 export cannot run on CPU (ONNX Runtime's CPU kernels lack bfloat16
    arithmetic: Mul, MatMul, ...); the conversion's check would refuse it after the whole export."""
    if export_dtype == "bfloat16" and "cpu" in providers:
        raise ConversionError(
            f"{label}: a bfloat16 export cannot run on CPU (ONNX Runtime has no bfloat16 kernel for Mul, "
            "MatMul, ...); pass --providers cuda if the model is meant for CUDA only, or --export-dtype float16 "
            "(the default) or float32"
        )
