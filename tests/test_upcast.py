"""A model that computes in float16, rewritten to compute in float32 from the same stored weights
(ortpa.parity.upcast): the half of a float32 twin that verification runs for float16 originals."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from ortpa.parity.upcast import computes_in_half, twin_session_options, upcast_to_float32

RNG = np.random.default_rng(5)
X = RNG.standard_normal((2, 8)).astype(np.float16)
W = RNG.standard_normal((8, 8)).astype(np.float16)
C = RNG.standard_normal(8).astype(np.float16)


def _half_model() -> onnx.ModelProto:
    """y = float16(float32(x @ w + c) * 3): float16 in, float16 out, a float16 weight and constant."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["xw"]),
        helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(C)),
        helper.make_node("Add", ["xw", "c"], ["z"]),
        helper.make_node("Cast", ["z"], ["z32"], to=TensorProto.FLOAT),
        helper.make_node("Constant", [], ["three"], value=numpy_helper.from_array(np.array(3.0, np.float32))),
        helper.make_node("Mul", ["z32", "three"], ["u"]),
        helper.make_node("Cast", ["u"], ["y"], to=TensorProto.FLOAT16),
    ]
    graph = helper.make_graph(
        nodes,
        "half",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2, 8])],
        [numpy_helper.from_array(W, "w")],
        value_info=[helper.make_tensor_value_info("xw", TensorProto.FLOAT16, [2, 8])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def test_the_upcast_model_computes_in_float32_from_the_stored_weights():
    model = _half_model()
    assert computes_in_half(model)
    stored = model.graph.initializer[0].SerializeToString()
    assert upcast_to_float32(model) == 5  # the weight, the constant, the cast to float16, the input, the output
    onnx.checker.check_model(model, full_check=True)
    # the weight is read as stored (same name, type and bytes), the graph's ends are float32
    assert model.graph.initializer[0].SerializeToString() == stored
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    got = _run(model, X.astype(np.float32))
    want = (X.astype(np.float32) @ W.astype(np.float32) + C.astype(np.float32)) * np.float32(3)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # the half model itself rounds to float16 twice: 2^-11 of the values, far past float32's sums
    assert np.abs(_run(_half_model(), X).astype(np.float32) - want).max() > 1e-3


def test_twin_sessions_cast_the_weights_per_use_instead_of_folding_them(tmp_path):
    """ONNX Runtime folds a Cast of an initializer into a float32 copy (twice the half weight in memory) unless
    constant folding is off, which twin_session_options does."""
    model = _half_model()
    upcast_to_float32(model)

    def casts_left(options: ort.SessionOptions) -> int:
        options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
        ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        optimized = onnx.load(str(tmp_path / "optimized.onnx"))
        return sum(n.op_type == "Cast" and n.input[0] == "w" for n in optimized.graph.node)

    assert casts_left(ort.SessionOptions()) == 0
    assert casts_left(twin_session_options(ort.SessionOptions())) == 1
