"""Hugging Face / torch causal LMs -> dense ONNX (the optional ``export`` extra; torch is imported lazily).

:mod:`~ortpa.export.hf` exports, :mod:`~ortpa.export.patches` holds what ``torch.onnx.export`` needs changed to
take MLA models as they ship, :mod:`~ortpa.export.errors` says a failed export in one line.
"""

from __future__ import annotations

from ortpa.export.errors import ExportError, ExportFailure
from ortpa.export.hf import ExportInfo, build_model, export_hf

__all__ = ["ExportError", "ExportFailure", "ExportInfo", "build_model", "export_hf"]
