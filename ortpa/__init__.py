"""ortpa: dense-attention ONNX LLMs to paged-KV models on ONNX Runtime's PagedAttention.

The public API, re-exported from the modules that implement it:

* :func:`convert_file` — dense ONNX (MLA, MHA, GQA) or a Hugging Face checkpoint -> a verified paged deployment
  folder (the model, ``genai_config.json``, tokenizer files; ``portable=True``: lowered to standard ONNX ops), with
  :class:`ConvertOptions`; a :class:`Conversion` back.
* :func:`convert` — the same rewrite and checks in memory: a ``ModelProto`` back, nothing written or verified.
* :func:`validate` — check every PagedAttention node of a model against ONNX Runtime's rules and a backend.
* :class:`InferenceSession` — drop-in ``onnxruntime.InferenceSession`` running PagedAttention on any EP.
* :class:`PagedSession` — caches owned as OrtValues and updated in place through IO binding.
* :class:`PagedKVCache` — the block manager that emits the op's index tensors.
* :class:`Engine` — continuous batching (chunked prefill, preemption, prefix caching, sampling).
* :func:`resolve_model` — a folder or a Hugging Face repo id in the local cache -> its ONNX file (offline).
* :func:`export_hf` — Hugging Face config or local model dir -> dense ONNX (needs the ``export`` extra).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module that defines it. Imported on first access (PEP 562), so that ``import ortpa`` (and
# with it every ``ortpa`` command's start, ``--version`` included) costs no onnx, ONNX Runtime or NumPy import.
_PUBLIC: dict[str, str] = {
    "ConcurrentUse": "ortpa.errors",
    "ConversionError": "ortpa.errors",
    "InvalidArgument": "ortpa.errors",
    "InvalidModel": "ortpa.errors",
    "InvalidRequest": "ortpa.errors",
    "KVPoolTooLarge": "ortpa.errors",
    "MissingExtra": "ortpa.errors",
    "NotImplementedByBackend": "ortpa.errors",
    "OrtpaError": "ortpa.errors",
    "OutOfBlocks": "ortpa.errors",
    "RequestTooLarge": "ortpa.errors",
    "RequestTooLong": "ortpa.errors",
    "Unavailable": "ortpa.errors",
    "NoOnnxFile": "ortpa.model.ref",
    "resolve_model": "ortpa.model.ref",
    "ValidationReport": "ortpa.ops.validate",
    "check_inputs": "ortpa.ops.validate",
    "validate": "ortpa.ops.validate",
    "convert": "ortpa.conversion",
    "convert_file": "ortpa.conversion",
    "Conversion": "ortpa.conversion",
    "ConvertOptions": "ortpa.conversion",
    "Engine": "ortpa.runtime.engine",
    "EngineStats": "ortpa.runtime.engine",
    "RequestOutput": "ortpa.runtime.engine",
    "PagedKVCache": "ortpa.runtime.kv",
    "StepInputs": "ortpa.runtime.kv",
    "SamplingParams": "ortpa.runtime.sampling",
    "InferenceSession": "ortpa.runtime.session",
    "PagedSession": "ortpa.runtime.session",
}

__all__ = [
    "ConcurrentUse",
    "Conversion",
    "ConversionError",
    "ConvertOptions",
    "Engine",
    "EngineStats",
    "InferenceSession",
    "InvalidArgument",
    "InvalidModel",
    "InvalidRequest",
    "KVPoolTooLarge",
    "MissingExtra",
    "NoOnnxFile",
    "NotImplementedByBackend",
    "OrtpaError",
    "OutOfBlocks",
    "PagedKVCache",
    "PagedSession",
    "RequestOutput",
    "RequestTooLarge",
    "RequestTooLong",
    "SamplingParams",
    "StepInputs",
    "Unavailable",
    "ValidationReport",
    "__version__",
    "check_inputs",
    "convert",
    "convert_file",
    "export_hf",
    "resolve_model",
    "validate",
]

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time each name comes from __getattr__
    from ortpa.conversion import Conversion, ConvertOptions, convert, convert_file
    from ortpa.errors import (
        ConcurrentUse,
        ConversionError,
        InvalidArgument,
        InvalidModel,
        InvalidRequest,
        KVPoolTooLarge,
        MissingExtra,
        NotImplementedByBackend,
        OrtpaError,
        OutOfBlocks,
        RequestTooLarge,
        RequestTooLong,
        Unavailable,
    )
    from ortpa.model.ref import NoOnnxFile, resolve_model
    from ortpa.ops.validate import ValidationReport, check_inputs, validate
    from ortpa.runtime.engine import Engine, EngineStats, RequestOutput
    from ortpa.runtime.kv import PagedKVCache, StepInputs
    from ortpa.runtime.sampling import SamplingParams
    from ortpa.runtime.session import InferenceSession, PagedSession


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'ortpa' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once: later lookups do not come back here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def export_hf(*args: Any, **kwargs: Any):
    """Export a Hugging Face model (config with random weights, or a local model dir) to dense ONNX.

    Needs the ``export`` extra (``pip install 'ortpa[export]'``); see :func:`ortpa.export.export_hf`.
    """
    from ortpa.export.hf import export_hf as _export_hf

    return _export_hf(*args, **kwargs)
