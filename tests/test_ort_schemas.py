"""The loader accepts what ONNX Runtime loads (ORT's schema registry), and still refuses unknown ops."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import helper, numpy_helper

from ortpa.errors import InvalidModel
from ortpa.model.file import read_model
from ortpa.model.ort_schemas import ort_schema


def _model(path, op_type: str, domain: str) -> str:
    sln = helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["y"], epsilon=1e-6, axis=-1)
    act = helper.make_node(op_type, ["y"], ["z"], domain=domain)
    graph = helper.make_graph(
        [sln, act],
        "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT, [2, 4])],
        initializer=[numpy_helper.from_array(np.full(4, 2.0, np.float32), "g")],
    )
    opsets = [helper.make_opsetid("", 22), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    onnx.save(model, path)
    return str(path)


def test_genai_style_ops_load_check_and_infer(tmp_path):
    path = _model(tmp_path / "m.onnx", "FastGelu", "com.microsoft")
    loaded = read_model(path)
    onnx.checker.check_model(loaded.proto)  # onnx alone rejects SimplifiedLayerNormalization in opset 22
    inferred = onnx.shape_inference.infer_shapes(loaded.proto)
    y = next(v for v in inferred.graph.value_info if v.name == "y")
    assert [d.dim_value for d in y.type.tensor_type.shape.dim] == [2, 4]
    # and ONNX Runtime runs it: the loader's verdict agrees with the runtime's
    x = np.arange(8, dtype=np.float32).reshape(2, 4) - 3
    (z,) = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    rms = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * 2.0
    assert z.shape == (2, 4) and np.isfinite(z).all() and not np.allclose(z, rms)  # FastGelu applied after


def test_unknown_contrib_op_is_refused(tmp_path):
    path = _model(tmp_path / "m.onnx", "NoSuchOp", "com.microsoft")
    with pytest.raises(InvalidModel, match=r"'NoSuchOp' does not exist in com.microsoft opset 1"):
        read_model(path)


def test_onnx_op_unknown_in_both_registries_is_refused(tmp_path):
    path = _model(tmp_path / "m.onnx", "Reluu", "")
    with pytest.raises(InvalidModel, match=r"'Reluu' does not exist in ai.onnx opset 22"):
        read_model(path)


def test_registry_lookup_follows_opset():
    gqa = ort_schema("com.microsoft", "GroupQueryAttention", 1)
    assert gqa is not None and gqa.min_input >= 7
    assert ort_schema("", "SimplifiedLayerNormalization", 22) is not None
    assert ort_schema("", "Relu", 22) is not None  # ORT registers the ONNX ops too
    assert ort_schema("com.microsoft", "GroupQueryAttention", 0) is None
