"""Element-type names for the type rules: :mod:`ortpa.dtypes`' names, made total for untrusted input.

:func:`dtype_name` is what every type rule compares; it never raises (a validator reads whatever a model
declares): ``None`` for an undeclared type, ``"unknown(<repr>)"`` for something that is not a type.
:func:`ort_type` spells a name the way ONNX Runtime's messages do (``tensor(float)``, ``tensor(float16)``, ...).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ortpa import dtypes

__all__ = ["dtype_name", "ort_type"]

_UNDEFINED = 0


def dtype_name(dtype: Any) -> str | None:
    """Normalise a numpy / ml_dtypes dtype, an ONNX ``TensorProto`` elem type or a type string to a name.

    Returns names like ``"float16"``, ``"bfloat16"``, ``"float8e4m3fn"``, ``"int32"``, ``"float32"``; ``None``
    when the type is unknown (not declared); ``"unknown(<repr>)"`` for something that is not a type at all.
    """
    if dtype is None or (isinstance(dtype, str) and not dtype.strip()):
        return None
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool) and int(dtype) == _UNDEFINED:
        return None
    try:
        return dtypes.dtype_name(dtype)
    except (TypeError, ValueError):  # not a dtype at all: report it, never crash
        if isinstance(dtype, str):
            s = dtype.strip().lower()
            return s[7:-1] if s.startswith("tensor(") and s.endswith(")") else s
        return f"unknown({int(dtype) if isinstance(dtype, (int, np.integer)) else dtype!r})"


def ort_type(name: str) -> str:
    """ONNX Runtime's spelling in messages: tensor(float), tensor(float16), ..."""
    return f"tensor({ {'float32': 'float', 'float64': 'double'}.get(name, name) })"
