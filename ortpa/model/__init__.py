"""Reading, locating and checking model files: everything between a model argument and the rewriter.

* :mod:`~ortpa.model.ref` — where a model is (an ``.onnx`` file, a folder, a Hugging Face repo id in the local
  cache, offline) and the companion files copied beside a converted model;
* :mod:`~ortpa.model.file` — the one loader (``read_model``), with :mod:`~ortpa.model.tensors` (tensor and
  external-data checks), :mod:`~ortpa.model.opsets` (domains, opsets, ONNX Runtime's version) and
  :mod:`~ortpa.model.ort_schemas` (what ONNX Runtime's own registry allows);
* :mod:`~ortpa.model.folder` — the text side of a model folder: tokenizer and EOS ids.
"""

from __future__ import annotations

from ortpa.model.file import LoadedModel, read_model
from ortpa.model.ref import ModelRef, NoOnnxFile, locate_model, resolve_any, resolve_model

__all__ = ["LoadedModel", "ModelRef", "NoOnnxFile", "locate_model", "read_model", "resolve_any", "resolve_model"]
