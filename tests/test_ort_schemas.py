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


def test_a_schema_onnx_refuses_is_logged_at_debug():
    """A schema onnx cannot take is left out with a debug line naming it and why (fresh process: registration
    happens once per process)."""
    import subprocess
    import sys

    code = (
        "import logging, onnx.defs\n"
        "logging.basicConfig(level=logging.DEBUG, format='%(name)s %(message)s')\n"
        "real = onnx.defs.register_schema\n"
        "def refuse(schema):\n"
        "    if schema.name == 'SimplifiedLayerNormalization':\n"
        "        raise RuntimeError('refused for the test')\n"
        "    real(schema)\n"
        "onnx.defs.register_schema = refuse\n"
        "from ortpa.model.ort_schemas import register_ort_default_domain_schemas\n"
        "names = register_ort_default_domain_schemas()\n"
        "assert not any(n.startswith('SimplifiedLayerNormalization-') for n in names), names\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "ortpa.model.ort_schemas ONNX Runtime schema SimplifiedLayerNormalization-1 not registered" in proc.stderr
    assert "refused for the test" in proc.stderr
