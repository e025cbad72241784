"""Sessions of rewritten models read large weights from the model's own data files when ORT may (no copies)."""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ortpa.model.file import read_model
from ortpa.runtime.ort_session import external_initializers, open_ort_session


def _model(folder, data_name: str = "m.onnx.data") -> str:
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 1000
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 10
    path = os.path.join(folder, "m.onnx")
    onnx.save_model(model, path, save_as_external_data=True, location=data_name, size_threshold=0)
    return path


def _run(path: str) -> tuple[np.ndarray, bool]:
    loaded = read_model(path, load_external_data=False)
    graph_only, external = external_initializers(loaded.proto, loaded.base_dir)
    opened = open_ort_session(loaded, graph_only, external, unchanged=False, providers=["CPUExecutionProvider"])
    x = np.ones((2, 64), np.float32)
    (y,) = opened.session.run(None, {"x": x})
    handed_over = any(len(a) for a in opened.keep_alive[0]) if opened.keep_alive else False
    return y, handed_over


def test_weights_in_the_models_folder_are_read_by_onnxruntime(tmp_path):
    y, handed_over = _run(_model(str(tmp_path)))
    w = np.arange(64 * 32, dtype=np.float32).reshape(64, 32) / 1000
    np.testing.assert_allclose(y, np.ones((2, 64), np.float32) @ w, rtol=1e-6)
    assert not handed_over  # no OrtValue copies: ORT maps the data file itself


# Data behind a link out of the folder (a Hugging Face cache snapshot's blobs/): ORT refuses such paths, so the
# session hands ortpa's own checked memory map over instead; tests/test_hf_cache.py runs that path end to end.
