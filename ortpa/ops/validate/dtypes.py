"""Element-type names: one spelling for numpy / ml_dtypes dtypes, ONNX elem types and type strings.

:func:`dtype_name` is what every type rule compares; :func:`ort_type` spells a name the way ONNX Runtime's
messages do (``tensor(float)``, ``tensor(float16)``, ...).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx

__all__ = ["dtype_name", "ort_type"]

_ONNX_ELEM: dict[int, str] = {
    num: {"FLOAT": "float32", "DOUBLE": "float64", "UNDEFINED": ""}.get(name, name.lower())
    for name, num in onnx.TensorProto.DataType.items()
}
_NP_ALIASES = {
    "float8_e4m3fn": "float8e4m3fn",
    "float8_e5m2": "float8e5m2",
    "float8_e4m3fnuz": "float8e4m3fnuz",
    "float8_e5m2fnuz": "float8e5m2fnuz",
    "float4_e2m1fn": "float4e2m1",
    "float": "float32",
    "double": "float64",
    "half": "float16",
}


def dtype_name(dtype: Any) -> str | None:
    """Normalise a numpy / ml_dtypes dtype, an ONNX ``TensorProto`` elem type or a type string to a name.

    Returns names like ``"float16"``, ``"bfloat16"``, ``"float8e4m3fn"``, ``"int32"``, ``"float32"``; ``None``
    when the type is unknown (not declared); ``"unknown(<repr>)"`` for something that is not a type at all.
    """
    if dtype is None:
        return None
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        name = _ONNX_ELEM.get(int(dtype))
        return (name or None) if name is not None else f"unknown({int(dtype)})"
    if isinstance(dtype, str):
        s = dtype.strip().lower()
        if s.startswith("tensor(") and s.endswith(")"):
            s = s[7:-1]
        return _NP_ALIASES.get(s, s) if s else None
    try:
        name = np.dtype(dtype).name
    except Exception:  # not a dtype at all: report it, never crash
        return f"unknown({dtype!r})"
    return _NP_ALIASES.get(name, name)


def ort_type(name: str) -> str:
    """ONNX Runtime's spelling in messages: tensor(float), tensor(float16), ..."""
    return f"tensor({ {'float32': 'float', 'float64': 'double'}.get(name, name) })"
