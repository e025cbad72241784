"""Which devices are present, without importing heavy CUDA libraries.

onnxruntime-gpu lists ``CUDAExecutionProvider`` as available even on machines without a GPU, so the
provider list alone cannot tell whether CUDA will run; the driver API can.
"""

from __future__ import annotations

import ctypes
import functools

from ortpa.providers import CPU, CUDA

__all__ = ["best_providers", "cuda_device_count", "has_cuda"]


@functools.lru_cache(maxsize=1)
def cuda_device_count() -> int:
    """Number of CUDA devices the driver reports; 0 when there is no driver or no device."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        try:
            if lib.cuInit(0) != 0:
                return 0
            count = ctypes.c_int(0)
            if lib.cuDeviceGetCount(ctypes.byref(count)) != 0:
                return 0
            return int(count.value)
        except AttributeError:
            return 0
    return 0


def has_cuda() -> bool:
    """True when onnxruntime has the CUDA provider and the driver reports at least one device."""
    import onnxruntime as ort

    return CUDA in ort.get_available_providers() and cuda_device_count() > 0


def best_providers() -> list[str]:
    """The provider list ortpa uses by default: CUDA first where it can run, then CPU."""
    return [CUDA, CPU] if has_cuda() else [CPU]
