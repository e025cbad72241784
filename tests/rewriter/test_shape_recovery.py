"""Graphs whose values carry no shapes (exports past 2 GB come without ``value_info``, and the optimizer infers no
shape past a contrib op): the pipeline recovers them (``ortpa.rewriter.shape_recovery``) so the per-sequence flow
can follow the token axis, and a value the flow still cannot follow to the logits or a cache is refused, never
converted on trust."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import helper
from support.flow_spy import record_sink_kinds

from ortpa.errors import ConversionError
from ortpa.rewriter import pipeline
from ortpa.rewriter.pipeline import convert

GPTOSS = Path(__file__).resolve().parents[1] / "fixtures" / "formats" / "genai_gptoss_fp32.onnx"  # contrib ops


def _shapeless(softmax_over_tokens: bool = False) -> onnx.ModelProto:
    """The genai gpt-oss fixture without value_info; optionally with the final hidden state's softmax over the
    tokens added back (``[B, T, D]``, axis 1): every token then depends on every sequence of the step."""
    model = onnx.load(str(GPTOSS))
    del model.graph.value_info[:]
    if softmax_over_tokens:
        lm_head = next(n for n in model.graph.node if "logits" in n.output)
        hidden = lm_head.input[0]
        model.graph.node.insert(
            len(model.graph.node) - 1,
            helper.make_node("Softmax", [hidden], ["probe/soft"], axis=1, name="token_softmax"),
        )
        model.graph.node.insert(len(model.graph.node) - 1, helper.make_node("Add", [hidden, "probe/soft"], ["probe/h"]))
        lm_head.input[0] = "probe/h"
    return model


def test_shapes_are_recovered_so_the_flow_reaches_every_sink_per_token(monkeypatch):
    seen = record_sink_kinds(monkeypatch)
    convert(_shapeless(), providers=())
    assert seen and seen[-1] <= {"token", "const"} and "token" in seen[-1], seen


def test_a_token_softmax_in_a_shapeless_graph_is_found_and_refused():
    with pytest.raises(ConversionError, match="cannot be made per sequence") as info:
        convert(_shapeless(softmax_over_tokens=True), providers=())
    assert any(
        "token_softmax" in where and "normalises across the token axis" in why for where, why in info.value.failures
    ), info.value


def test_what_the_flow_cannot_follow_is_refused_not_converted(monkeypatch):
    """Shapes left unknown (the recovery switched off): the flow loses the token axis before the logits and the
    caches, so the conversion is refused, naming where it lost it."""
    monkeypatch.setattr(pipeline, "recover_shapes", lambda irm: 0)
    with pytest.raises(ConversionError, match="cannot be made per sequence") as info:
        convert(_shapeless(), providers=())
    assert any("the flow cannot follow the token axis" in why for _, why in info.value.failures), info.value


def test_unknown_dims_are_filled_with_numbers_and_the_inputs_symbols():
    """optimum's reshapes to targets read with Shape leave ``[None, None, None, None]``: recovery fills the dims
    (``[batch, seq, 4, 16]``) with numbers and symbols of the graph's inputs only, never ones inference made up."""
    import numpy as np
    import onnx_ir as ir

    from ortpa.rewriter.shape_recovery import recover_shapes

    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["batch", "seq", 64])
    inits = [
        onnx.numpy_helper.from_array(np.array([0, 1], np.int64), "lead"),
        onnx.numpy_helper.from_array(np.array([4, 16], np.int64), "heads"),
    ]
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "lead"], ["bs"]),
        helper.make_node("Concat", ["bs", "heads"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["y"]),
        helper.make_node("NonZero", ["y"], ["nz"]),  # [4, unknown]: inference names that dim itself
    ]
    outs = [helper.make_tensor_value_info("nz", onnx.TensorProto.INT64, None)]
    model = ir.serde.deserialize_model(
        helper.make_model(helper.make_graph(nodes, "g", [x], outs, inits), opset_imports=[helper.make_opsetid("", 18)])
    )
    values = {o.name: o for n in model.graph for o in n.outputs}
    values["y"].shape = ir.Shape([None, None, None, None])
    values["nz"].shape = ir.Shape([None, None])
    assert recover_shapes(model) >= 1
    y = [d if isinstance(d, int) else d.value for d in values["y"].shape]
    assert y == ["batch", "seq", 4, 16], y
    nz = values["nz"].shape
    assert nz[0] == 4 and not (isinstance(nz[1], ir.SymbolicDim) and nz[1].value), nz
