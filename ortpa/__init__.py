"""ortpa: dense-attention ONNX LLMs to paged-KV models on ONNX Runtime's PagedAttention.

The public API, re-exported from the modules that implement it:

* :func:`convert` / :func:`convert_file` — dense ONNX (MLA, MHA, GQA) -> paged PagedAttention model;
  ``convert_file(..., portable=True)`` lowers it to standard ONNX ops, and writes a ``genai_config.json`` beside it.
* :func:`validate` — check every PagedAttention node of a model against ONNX Runtime's rules and a backend.
* :class:`InferenceSession` — drop-in ``onnxruntime.InferenceSession`` running PagedAttention on any EP.
* :class:`PagedSession` — caches owned as OrtValues and updated in place through IO binding.
* :class:`PagedKVCache` — the block manager that emits the op's index tensors.
* :class:`Engine` — continuous batching (chunked prefill, preemption, prefix caching, sampling).
* :func:`resolve_model` — a folder or a Hugging Face repo id in the local cache -> its ONNX file (offline).
* :func:`export_hf` — Hugging Face config or local model dir -> dense ONNX (needs the ``export`` extra).
"""

from __future__ import annotations

from typing import Any

from ortpa.deploy.deployment import convert_file  # the conversion, then --portable / genai_config.json
from ortpa.errors import (
    ConcurrentUse,
    ConversionError,
    InvalidArgument,
    InvalidModel,
    InvalidRequest,
    KVPoolTooLarge,
    NotImplementedByBackend,
    OrtpaError,
    OutOfBlocks,
    RequestTooLarge,
    RequestTooLong,
)
from ortpa.model.ref import NoOnnxFile, resolve_model
from ortpa.ops.validate import ValidationReport, check_inputs, validate
from ortpa.parity.convert_file import convert
from ortpa.runtime.engine import Engine, EngineStats, RequestOutput
from ortpa.runtime.kv import PagedKVCache, StepInputs
from ortpa.runtime.sampling import SamplingParams
from ortpa.runtime.session import InferenceSession, PagedSession

__version__ = "0.1.0"

__all__ = [
    "ConcurrentUse",
    "ConversionError",
    "Engine",
    "EngineStats",
    "InferenceSession",
    "InvalidArgument",
    "InvalidModel",
    "InvalidRequest",
    "KVPoolTooLarge",
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
    "ValidationReport",
    "__version__",
    "check_inputs",
    "convert",
    "convert_file",
    "export_hf",
    "resolve_model",
    "validate",
]


def export_hf(*args: Any, **kwargs: Any):
    """Export a Hugging Face model (config with random weights, or a local model dir) to dense ONNX.

    Needs the ``export`` extra (``pip install 'ortpa[export]'``); see :func:`ortpa.export.export_hf`.
    """
    from ortpa.export.hf import export_hf as _export_hf

    return _export_hf(*args, **kwargs)
