"""The one conversion path, above the rewriter, the runtime, parity and deploy (see :mod:`.orchestrator`).

* :func:`convert_file` (``ortpa.convert_file``, ``ortpa convert``): a dense model or a Hugging Face checkpoint ->
  a verified deployment folder, published with one move;
* :func:`convert` (``ortpa.convert``): the same rewrite and checks in memory, a ModelProto back, nothing written;
* :func:`export_dense` (``ortpa export``): a Hugging Face model -> dense ONNX;
* :class:`ConvertOptions` / :class:`ExportOptions`: every option, in one place.
"""

from __future__ import annotations

from ortpa.conversion.options import ConvertOptions, ExportOptions
from ortpa.conversion.orchestrator import Conversion, convert, convert_file, export_dense

__all__ = ["Conversion", "ConvertOptions", "ExportOptions", "convert", "convert_file", "export_dense"]
