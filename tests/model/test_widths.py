"""The one width walker (:mod:`ortpa.model.widths`) against what ONNX Runtime computes for the same graphs.

Each graph's input has symbolic dims, so the declared output shape is unknown and the walker must find the dims
in the weights; ONNX Runtime then runs the graph on a concrete input and its output shape is the truth.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortpa.model.widths import dim, static_width

RNG = np.random.default_rng(0)


def _init(name: str, arr) -> TensorProto:
    return numpy_helper.from_array(np.asarray(arr), name)


def _model(nodes, inits, x_shape=("b", "s", 16), x_type=TensorProto.FLOAT) -> onnx.ModelProto:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", x_type, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


W = RNG.standard_normal((16, 24)).astype(np.float32)

CASES = {
    "matmul": ([helper.make_node("MatMul", ["x", "w"], ["y"])], [_init("w", W)]),
    "matmul_bias_cast": (
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Add", ["h", "bias"], ["a"]),
            helper.make_node("Cast", ["a"], ["y"], to=TensorProto.FLOAT),
        ],
        [_init("w", W), _init("bias", np.zeros(24, np.float32))],
    ),
    "gemm_transposed": (
        [
            helper.make_node("Reshape", ["x", "flat"], ["x2"]),
            helper.make_node("Gemm", ["x2", "wt"], ["y"], transB=1),
        ],
        [_init("flat", np.array([-1, 16], np.int64)), _init("wt", W.T.copy())],
    ),
    "reshape_heads_transpose": (
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Reshape", ["h", "target"], ["r"]),  # [b, s, 4, 6] with 0, 0, 4, -1
            helper.make_node("Transpose", ["r"], ["y"], perm=[0, 2, 1, 3]),
        ],
        [_init("w", W), _init("target", np.array([0, 0, 4, -1], np.int64))],
    ),
    "split_last_axis": (
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Split", ["h", "sizes"], ["q", "y"], axis=-1),
        ],
        [_init("w", W), _init("sizes", np.array([16, 8], np.int64))],
    ),
    "embedding_then_norm": (
        [
            helper.make_node("Gather", ["table", "ids"], ["e"]),
            helper.make_node("Relu", ["e"], ["y"]),
        ],
        [_init("table", RNG.standard_normal((50, 12)).astype(np.float32))],
    ),
}


def _run(model: onnx.ModelProto, name: str) -> tuple[int, ...]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    inp = sess.get_inputs()[0]
    if inp.type == "tensor(int64)":
        feed = np.zeros((2, 3), np.int64)
    else:
        feed = RNG.standard_normal((2, 3, 16)).astype(np.float32)
    return sess.run(None, {inp.name: feed})[0].shape


@pytest.mark.parametrize("name", sorted(CASES))
def test_walker_agrees_with_onnxruntime(name: str) -> None:
    nodes, inits = CASES[name]
    if name == "embedding_then_norm":
        for n in nodes:
            n.input[:] = ["table", "x"] if n.op_type == "Gather" else n.input
        model = _model(nodes, inits, x_shape=("b", "s"), x_type=TensorProto.INT64)
    else:
        model = _model(nodes, inits)
    truth = _run(model, name)
    graph = ir.serde.deserialize_model(model).graph
    y = graph.outputs[0]
    assert y.shape is None or all(not isinstance(d, int) for d in y.shape)  # nothing declared: the walk decides
    assert static_width(y) == truth[-1]
    for axis in range(-len(truth), 0):
        found = dim(y, axis)
        # batch and sequence dims are symbolic in the graph: the walker must say None, never a guess
        assert found is None or found == truth[axis], (axis, found, truth)
    if name == "reshape_heads_transpose":
        assert dim(y, -3) == 4  # the head count, moved by the Transpose


def test_unknown_producer_is_none() -> None:
    model = _model([helper.make_node("Softmax", ["x"], ["y"])], [])
    graph = ir.serde.deserialize_model(model).graph
    assert static_width(graph.outputs[0]) is None  # Softmax keeps the shape, but the walker only claims what it knows
