"""Device-memory operations on CUDA OrtValues through cuda-python (the `cuda` extra).

Only imported when a cache lives on a CUDA device; CPU-only installs never load cuda-python.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnxruntime as ort

__all__ = ["copy_device_blocks", "device_to_host", "free_device_memory"]


def _runtime():
    try:
        from cuda.bindings import runtime as cudart  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart  # older cuda-python layout
        except ImportError as exc:
            raise ImportError("cuda-python is needed for device caches: pip install 'ortpa[cuda]'") from exc
    return cudart


def _check(result) -> tuple:
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise RuntimeError(f"CUDA runtime call failed with error {int(err)} ({err})")
    return tuple(rest)


def free_device_memory(device_id: int = 0) -> tuple[int, int]:
    """(free bytes, total bytes) on ``device_id`` (cudaMemGetInfo)."""
    cudart = _runtime()
    _check(cudart.cudaSetDevice(device_id))
    free, total = _check(cudart.cudaMemGetInfo())
    return int(free), int(total)


def copy_device_blocks(value: ort.OrtValue, pairs: Iterable[tuple[int, int]]) -> None:
    """Copy whole blocks (dimension 0) src -> dst inside one device tensor with device-to-device memcpy."""
    cudart = _runtime()
    shape = value.shape()
    block_bytes = value.tensor_size_in_bytes() // max(shape[0], 1)
    base = value.data_ptr()
    kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToDevice
    for src, dst in pairs:
        _check(cudart.cudaMemcpy(base + dst * block_bytes, base + src * block_bytes, block_bytes, kind))


def device_to_host(value: ort.OrtValue, dtype: np.dtype) -> np.ndarray:
    """A host copy of a device tensor of any dtype (bfloat16 and float8 included)."""
    cudart = _runtime()
    out = np.empty(tuple(value.shape()), dtype=dtype)
    kind = cudart.cudaMemcpyKind.cudaMemcpyDeviceToHost
    _check(cudart.cudaMemcpy(out.ctypes.data, value.data_ptr(), value.tensor_size_in_bytes(), kind))
    return out
