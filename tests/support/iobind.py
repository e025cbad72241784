"""Binding NumPy arrays (bfloat16 and float8 included) to ONNX Runtime IO bindings in place, for the tests.

ONNX Runtime's Python API has no NumPy path for ml_dtypes types; binding the array's own buffer also lets a
test alias a cache input and its output, as the runtime does.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import helper

__all__ = ["bind_cpu"]


def bind_cpu(io: ort.IOBinding, name: str, array: np.ndarray, *, output: bool = False) -> None:
    """Bind ``array`` (C-contiguous; the caller keeps it alive until the run ends) as input or output ``name``."""
    elem = helper.np_dtype_to_tensor_dtype(array.dtype)
    bind = io.bind_output if output else io.bind_input
    bind(name, "cpu", 0, elem, array.shape, array.ctypes.data)
