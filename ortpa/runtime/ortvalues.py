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

from ortpa.dtypes import numpy_dtype, onnx_elem_type

__all__ = [
    "numpy_dtype_for_onnx",
    "onnx_type_of",
    "ortvalue_to_numpy",
    "to_ortvalue",
]

# dtypes numpy-side onnxruntime does not understand: pass the bytes through a same-width integer view
_RAW_VIEW = {
    np.dtype(ml_dtypes.bfloat16): np.uint16,
    np.dtype(ml_dtypes.float8_e4m3fn): np.uint8,
}


def onnx_type_of(array: np.ndarray) -> int:
    """The ONNX element type of ``array`` (:func:`ortpa.dtypes.onnx_elem_type`)."""
    return onnx_elem_type(array.dtype)


def numpy_dtype_for_onnx(elem_type: int | str) -> np.dtype:
    """numpy dtype of an ONNX element type given as a TensorProto int or an ORT type string."""
    return numpy_dtype(elem_type)


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
