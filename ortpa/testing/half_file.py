"""A float32 test model file rewritten to compute in float16 throughout, streaming its weights (benchmarks of
float16 originals: ``python -m ortpa.bench.convert --verify-only --float16``).

Every float32 initializer, constant, cast target, graph input/output and ``value_info`` becomes float16; the
external weights are read one at a time from the source's data file and written to ``<out>.data``. Memory: one
weight at a time.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["float16_copy"]

_F32, _F16 = onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16


def float16_copy(path: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Write ``path`` (a float32 model, weights inline or external in its folder) as a float16 model at ``out``
    with its weights in ``<out>.data``; returns ``out``."""
    path, out = Path(path), Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(path), load_external_data=False)
    location = out.name + ".data"
    with open(out.parent / location, "wb") as data:
        for init in model.graph.initializer:
            if init.data_type != _F32:
                continue
            with np.errstate(over="ignore"):  # a mask's -1e9 becomes -inf, as in a float16 export
                array = _read(init, path.parent).astype(np.float16)
            if array.nbytes < 1024:
                init.CopyFrom(numpy_helper.from_array(array, init.name))
                continue
            offset = data.tell()
            data.write(array.tobytes())
            del init.external_data[:]
            init.ClearField("raw_data")
            init.data_type = _F16
            init.data_location = onnx.TensorProto.EXTERNAL
            for key, value in (("location", location), ("offset", str(offset)), ("length", str(array.nbytes))):
                entry = init.external_data.add()
                entry.key, entry.value = key, value
    for node in model.graph.node:
        for a in node.attribute:
            if node.op_type == "Cast" and a.name == "to" and a.i == _F32:
                a.i = _F16
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == _F32:
                with np.errstate(over="ignore"):
                    half = numpy_helper.to_array(a.t).astype(np.float16)
                a.t.CopyFrom(numpy_helper.from_array(half, a.t.name))
    for value in [*model.graph.input, *model.graph.output, *model.graph.value_info]:
        if value.type.tensor_type.elem_type == _F32:
            value.type.tensor_type.elem_type = _F16
    onnx.save_model(model, str(out))
    return out


def _read(init: onnx.TensorProto, folder: Path) -> np.ndarray:
    if init.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(init)
    info = {e.key: e.value for e in init.external_data}
    count = int(np.prod(init.dims, dtype=np.int64)) if init.dims else 1
    array = np.fromfile(folder / info["location"], np.float32, count, offset=int(info.get("offset", 0)))
    return array.reshape(tuple(init.dims))
