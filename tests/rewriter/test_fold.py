"""ortpa.rewriter._fold: values read from static dimensions of partly symbolic shapes, folded or refused."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortpa.rewriter._fold import fold_partial, fold_shape_values, fold_static, runtime_scalar
from ortpa.rewriter.recognisers._match import MatchFail, strip_scales


def _model(axis: int) -> ir.Model:
    """q [B, 4, S, 16] -> scale = Sqrt(1 / Sqrt(Cast(Shape(q)[axis]))) -> y = q * scale."""
    nodes = [
        helper.make_node("Shape", ["q"], ["shape"]),
        helper.make_node("Slice", ["shape", "starts", "ends"], ["dim"]),
        helper.make_node("Cast", ["dim"], ["dimf"], to=TensorProto.FLOAT),
        helper.make_node("Sqrt", ["dimf"], ["sqrt"]),
        helper.make_node("Div", ["one", "sqrt"], ["inv"]),
        helper.make_node("Sqrt", ["inv"], ["scale"]),
        helper.make_node("Mul", ["q", "scale"], ["y"]),
        helper.make_node("Concat", ["shape", "extra"], ["concat"], axis=0),
    ]
    inits = [
        numpy_helper.from_array(np.array([axis], np.int64), "starts"),
        numpy_helper.from_array(np.array([axis + 1 if axis + 1 else 2**62], np.int64), "ends"),
        numpy_helper.from_array(np.array(1.0, np.float32), "one"),
        numpy_helper.from_array(np.array([7], np.int64), "extra"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, ["B", 4, "S", 16])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("concat", TensorProto.INT64, None),
        ],
        inits,
    )
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    return ir.serde.deserialize_model(model)


def _value(model: ir.Model, name: str) -> ir.Value:
    return next(o for n in model.graph for o in n.outputs if o.name == name)


def test_static_head_size_folds_and_strips():
    model = _model(-1)
    scale = _value(model, "scale")
    assert fold_static(scale).reshape(()) == pytest.approx(16**-0.25)
    assert fold_partial(_value(model, "concat")).tolist() == [None, 4, None, 16, 7]
    assert fold_static(_value(model, "concat")) is None  # symbolic dims are never numbers
    base, factor = strip_scales(_value(model, "y"))
    assert base.name == "q" and factor == pytest.approx(16**-0.25)


def test_sequence_dependent_scale_is_refused_naming_the_node():
    model = _model(-2)
    scale = _value(model, "scale")
    assert fold_static(scale) is None and runtime_scalar(scale)
    with pytest.raises(MatchFail, match="'scale', a factor computed at run time"):
        strip_scales(_value(model, "y"))


def test_fold_pass_replaces_the_shape_arithmetic():
    model = _model(-1)
    assert fold_shape_values(model) == 1  # the scale; its intermediates are gone with their nodes
    ops = [n.op_type for n in model.graph]
    assert "Sqrt" not in ops and "Div" not in ops
    mul = next(n for n in model.graph if n.op_type == "Mul")
    assert mul.inputs[1].const_value.numpy().reshape(()) == pytest.approx(16**-0.25)
    assert "Concat" in ops  # a shape with symbolic dims stays computed
    unchanged = _model(-2)
    assert fold_shape_values(unchanged) == 0


def _projection_graph(width: int, row: int, slice_axis: int, start: int, end: int) -> ir.Value:
    """x [B, S, 64] @ W [64, width] -> Reshape(Concat(Shape(x)[:2], [-1, row])) -> Slice(axis) -> Transpose: the
    query as the attention reads it, with symbolic heads (the TorchScript exporters' reshape)."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["proj"]),
        helper.make_node("Shape", ["x"], ["xs"], end=2),
        helper.make_node("Concat", ["xs", "tail"], ["target"], axis=0),
        helper.make_node("Reshape", ["proj", "target"], ["heads"]),
        helper.make_node("Slice", ["heads", "starts", "ends", "axes"], ["q"]),
        helper.make_node("Transpose", ["q"], ["query"], perm=[0, 2, 1, 3]),
    ]
    inits = [
        numpy_helper.from_array(np.zeros((64, width), np.float32), "w"),
        numpy_helper.from_array(np.array([-1, row], np.int64), "tail"),
        numpy_helper.from_array(np.array([start], np.int64), "starts"),
        numpy_helper.from_array(np.array([end], np.int64), "ends"),
        numpy_helper.from_array(np.array([slice_axis], np.int64), "axes"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", "S", 64])],
        [helper.make_tensor_value_info("query", TensorProto.FLOAT, None)],
        inits,
    )
    model = ir.serde.deserialize_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    return next(o for n in model.graph for o in n.outputs if o.name == "query")


def test_heads_of_a_fused_qkv_viewed_per_head():
    """[B, S, H, 3*D] split along the last axis (q = [..., :D]): H = 4 heads, not 3 * 4."""
    from ortpa.rewriter.recognisers.decomposed import _heads_from_projection

    assert _heads_from_projection(_projection_graph(3 * 4 * 16, 3 * 16, -1, 0, 16), 16) == 4


def test_heads_of_multi_query_from_the_heads_slice():
    """Falcon-style [B, S, H + 2, D] with q = [:, :, :H]: H = 4 query heads, not the 6 rows of the projection."""
    from ortpa.rewriter.recognisers.decomposed import _heads_from_projection

    assert _heads_from_projection(_projection_graph(6 * 16, 16, 2, 0, 4), 16) == 4
