"""Which tool made a dense ONNX LLM, and how to feed it (the source side of ``ortpa parity``).

:mod:`~ortpa.formats.detect` reads a model's interface (dynamo export, onnxruntime-genai builder, optimum,
transformers' ``OnnxExporter``); :mod:`~ortpa.formats.shapes` recovers what a graph leaves symbolic (a cache's
head size and capacity).
"""

from __future__ import annotations

from ortpa.formats.detect import (
    CacheIO,
    DenseInterface,
    SourceFormat,
    dense_interface,
    detect_format,
    length_thresholds,
    session_interface,
)

__all__ = [
    "CacheIO",
    "DenseInterface",
    "SourceFormat",
    "dense_interface",
    "detect_format",
    "length_thresholds",
    "session_interface",
]
