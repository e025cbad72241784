"""The one dtype table of the package: ONNX element type <-> NumPy dtype <-> name, through onnx-ir.

``onnx_ir.DataType`` already maps every ONNX element type to its NumPy dtype (``ml_dtypes`` for bfloat16, the
float8 and the 4-bit types), its name and its size; this module only adds the spellings ortpa meets besides a
``TensorProto`` int: ONNX Runtime's type strings (``"tensor(float16)"``) and NumPy-style names
(``"float16"``, ``"bfloat16"``, ``"float32"``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

__all__ = ["bits", "dtype_name", "numpy_dtype", "onnx_elem_type"]

_ORT_PREFIX, _ORT_SUFFIX = "tensor(", ")"


def _data_type(x: Any) -> ir.DataType:
    if isinstance(x, ir.DataType):
        return x
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return ir.DataType(int(x))
    if isinstance(x, str):
        name = x[len(_ORT_PREFIX) : -len(_ORT_SUFFIX)] if x.startswith(_ORT_PREFIX) else x
        name = name.upper()
        if name == "FLOAT32":
            name = "FLOAT"
        elif name == "FLOAT64":
            name = "DOUBLE"
        elif name == "FLOAT8_E4M3FN":
            name = "FLOAT8E4M3FN"
        try:
            return ir.DataType[name]
        except KeyError:
            raise TypeError(f"unknown element type {x!r} (expected an ONNX or NumPy dtype name)") from None
    try:
        return ir.DataType.from_numpy(np.dtype(x))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"no ONNX element type for {x!r}: {exc}") from None


def onnx_elem_type(x: Any) -> int:
    """The ``TensorProto`` element type of ``x``: a NumPy dtype or type, a name, an ORT type string or an int."""
    return int(_data_type(x))


def numpy_dtype(x: Any) -> np.dtype:
    """The NumPy dtype (``ml_dtypes`` where NumPy has none) of an element type given in any spelling."""
    dt = _data_type(x)
    try:
        return np.dtype(dt.numpy())
    except (TypeError, ValueError):
        raise TypeError(f"no NumPy dtype for ONNX element type {dt.name}") from None


def dtype_name(x: Any) -> str:
    """NumPy-style name of an element type: ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"int8"``..."""
    return numpy_dtype(x).name


def bits(x: Any) -> int:
    """Bits per element (4 for the packed 4-bit types)."""
    return int(_data_type(x).itemsize * 8)
