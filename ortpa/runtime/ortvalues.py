"""numpy <-> OrtValue for every dtype ortpa uses, bfloat16 and float8 included.

onnxruntime's Python layer cannot convert ml_dtypes arrays (bfloat16, float8_e4m3fn) on its own: it rejects
them as inputs and cannot turn such outputs back into numpy. These helpers go through the raw bytes instead.
On CPU, an OrtValue made here shares memory with its numpy array, which is what cache aliasing relies on.
"""

from __future__ import annotations

import ctypes

import ml_dtypes
import numpy as np
import onnxruntime as ort
from onnx import TensorProto

__all__ = [
    "NUMPY_TO_ONNX",
    "numpy_dtype_for_onnx",
    "onnx_type_of",
    "ortvalue_to_numpy",
    "to_ortvalue",
]

NUMPY_TO_ONNX: dict[np.dtype, int] = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16,
    np.dtype(ml_dtypes.float8_e4m3fn): TensorProto.FLOAT8E4M3FN,
    np.dtype(np.float64): TensorProto.DOUBLE,
    np.dtype(np.int8): TensorProto.INT8,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int16): TensorProto.INT16,
    np.dtype(np.uint16): TensorProto.UINT16,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.bool_): TensorProto.BOOL,
}
_ONNX_TO_NUMPY = {v: k for k, v in NUMPY_TO_ONNX.items()}
# dtypes numpy-side onnxruntime does not understand: pass the bytes through a same-width integer view
_RAW_VIEW = {
    np.dtype(ml_dtypes.bfloat16): np.uint16,
    np.dtype(ml_dtypes.float8_e4m3fn): np.uint8,
}
_ORT_TYPE_STR = {
    "tensor(float)": TensorProto.FLOAT,
    "tensor(float16)": TensorProto.FLOAT16,
    "tensor(bfloat16)": TensorProto.BFLOAT16,
    "tensor(float8e4m3fn)": TensorProto.FLOAT8E4M3FN,
    "tensor(double)": TensorProto.DOUBLE,
    "tensor(int8)": TensorProto.INT8,
    "tensor(uint8)": TensorProto.UINT8,
    "tensor(int16)": TensorProto.INT16,
    "tensor(uint16)": TensorProto.UINT16,
    "tensor(int32)": TensorProto.INT32,
    "tensor(int64)": TensorProto.INT64,
    "tensor(bool)": TensorProto.BOOL,
}


def onnx_type_of(array: np.ndarray) -> int:
    try:
        return NUMPY_TO_ONNX[array.dtype]
    except KeyError:
        raise TypeError(f"no ONNX element type for numpy dtype {array.dtype}") from None


def numpy_dtype_for_onnx(elem_type: int | str) -> np.dtype:
    """numpy dtype of an ONNX element type given as a TensorProto int or an ORT type string."""
    if isinstance(elem_type, str):
        elem_type = _ORT_TYPE_STR[elem_type]
    try:
        return _ONNX_TO_NUMPY[elem_type]
    except KeyError:
        raise TypeError(f"no numpy dtype for ONNX element type {elem_type}") from None


def to_ortvalue(array: np.ndarray, device: str = "cpu", device_id: int = 0) -> ort.OrtValue:
    """An OrtValue holding ``array``; on CPU it shares the array's memory (the array must stay alive)."""
    array = np.ascontiguousarray(array)
    raw = _RAW_VIEW.get(array.dtype)
    if raw is None:
        return ort.OrtValue.ortvalue_from_numpy(array, device, device_id)
    view = array.view(raw)
    if device == "cpu":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(view, onnx_type_of(array))
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(array.shape), onnx_type_of(array), device, device_id)
    value.update_inplace(view)
    return value


def ortvalue_to_numpy(value: ort.OrtValue) -> np.ndarray:
    """A numpy copy of an OrtValue (CPU, or CUDA through cuda-python), whatever its element type."""
    dtype = numpy_dtype_for_onnx(value.data_type())
    if dtype not in _RAW_VIEW:
        return np.array(value.numpy(), copy=True)
    if value.device_name().lower() != "cpu":
        from ortpa.runtime.cuda_memory import device_to_host

        return device_to_host(value, dtype)
    shape = tuple(value.shape())
    nbytes = value.tensor_size_in_bytes()
    buf = (ctypes.c_uint8 * nbytes).from_address(value.data_ptr()) if nbytes else b""
    return np.frombuffer(bytes(buf), dtype=dtype).reshape(shape).copy()
