"""Reading an initializer's elements where they are stored (its model's external data files or its bytes), a
range at a time: the verification compares and rebuilds weights without loading a model."""

from __future__ import annotations

import os

import onnx

__all__ = ["read_array", "reader", "size"]


def reader(tensor: onnx.TensorProto, base_dir):
    """``(start, count) -> the flat elements [start, start + count)`` of ``tensor``, read from its file (external
    data) or its bytes as needed."""
    import numpy as np
    from onnx import numpy_helper

    from ortpa.dtypes import numpy_dtype

    dtype = np.dtype(numpy_dtype(tensor.data_type))
    total = size(tensor)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        entries = {e.key: e.value for e in tensor.external_data}
        path = os.path.join(os.fspath(base_dir or ""), entries["location"])
        offset = int(entries.get("offset", 0))

        def external(start: int, count: int):
            count = max(0, min(count, total - start))
            return np.fromfile(path, dtype, count, offset=offset + start * dtype.itemsize)

        return external
    if tensor.raw_data:
        raw = tensor.raw_data

        def inline(start: int, count: int):
            count = max(0, min(count, total - start))
            return np.frombuffer(raw, dtype, count, offset=start * dtype.itemsize)

        return inline
    flat = numpy_helper.to_array(tensor).reshape(-1)  # typed fields: small tensors
    return lambda start, count: flat[start : start + count]


def read_array(tensor: onnx.TensorProto, base_dir):
    """``tensor`` whole, in its own element type and shape (one tensor's memory)."""
    return reader(tensor, base_dir)(0, size(tensor)).reshape(tuple(tensor.dims))


def size(init: onnx.TensorProto) -> int:
    n = 1
    for d in init.dims:
        n *= d
    return n
