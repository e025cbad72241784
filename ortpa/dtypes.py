"""The one dtype table of the package: ONNX element type <-> NumPy dtype <-> name, through onnx-ir.

``onnx_ir.DataType`` already maps every ONNX element type to its NumPy dtype (``ml_dtypes`` for bfloat16, the
float8 and the 4-bit types), its name and its size; this module only adds the spellings ortpa meets besides a
``TensorProto`` int: ortpa's names (the ONNX name in lower case, ``float32`` / ``float64`` for FLOAT / DOUBLE:
``"float16"``, ``"bfloat16"``, ``"float8e4m3fn"``, ``"int4"``), NumPy's (``"float8_e4m3fn"``) and ONNX
Runtime's type strings (``"tensor(float16)"``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx_ir as ir

__all__ = ["bits", "dtype_name", "numpy_dtype", "onnx_elem_type", "ort_type"]

_NAME_OF = {ir.DataType.FLOAT: "float32", ir.DataType.DOUBLE: "float64"}
_BY_NAME = {**{dt.name.lower(): dt for dt in ir.DataType}, **{v: k for k, v in _NAME_OF.items()}}
_BY_NAME.update({"float": ir.DataType.FLOAT, "double": ir.DataType.DOUBLE, "half": ir.DataType.FLOAT16})
_ORT_SPELLING = {"float32": "float", "float64": "double"}


def _data_type(x: Any) -> ir.DataType:
    if isinstance(x, ir.DataType):
        return x
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        try:
            return ir.DataType(int(x))
        except ValueError:
            raise TypeError(f"no ONNX element type {int(x)}") from None
    if isinstance(x, str):
        s = x.strip().lower()
        if s.startswith("tensor(") and s.endswith(")"):
            s = s[7:-1]
        if s in _BY_NAME:
            return _BY_NAME[s]
    try:
        return ir.DataType.from_numpy(np.dtype(x))
    except (TypeError, ValueError) as exc:
        raise TypeError(f"no ONNX element type for {x!r} (expected a dtype, a dtype name or an ONNX type)") from exc


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
    """ortpa's name of an element type: ``"float32"``, ``"float16"``, ``"bfloat16"``, ``"float8e4m3fn"``..."""
    dt = _data_type(x)
    return _NAME_OF.get(dt, dt.name.lower())


def ort_type(x: Any) -> str:
    """ONNX Runtime's spelling in its messages: ``tensor(float)``, ``tensor(float16)``..."""
    name = dtype_name(x)
    return f"tensor({_ORT_SPELLING.get(name, name)})"


def bits(x: Any) -> int:
    """Bits per element (4 for the packed 4-bit types)."""
    return int(_data_type(x).itemsize * 8)
