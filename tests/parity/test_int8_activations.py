"""Originals that quantize activations to int8 (onnxruntime-genai's int4 builds, MatMulNBits ``accuracy_level=4``):
the structure is proved with float32 activations on both sides (:mod:`ortpa.parity.activations`) at the float32
bound. Before, the deployed model was its own twin at int8's bound (1.0 of the logits' scale), where a softmax
scale x1.1 passed (4.5e-2 of the scale)."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from ortpa.conversion import convert_file
from ortpa.errors import ConversionError
from ortpa.parity.activations import int8_activation_matmuls, switch_to_float32_activations
from ortpa.parity.twin import accumulation_length
from ortpa.parity.verify import verify_conversion
from ortpa.testing import defects
from ortpa.tolerances import structure_tolerance

INT4 = Path(__file__).parents[1] / "fixtures" / "formats" / "genai_qwen3_int4.onnx"


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    out = tmp_path_factory.mktemp("int4") / "paged.onnx"
    return out, convert_file(INT4, out).verification.verdict


def test_an_int4_builds_conversion_is_proved_at_the_float32_bound(int4):
    path, verdict = int4
    s, p = verdict.structure, verdict.precision
    assert s.twin and s.arithmetic == "float32" and s.ok
    header = onnx.load(str(path), load_external_data=False)
    assert s.tolerance == structure_tolerance("float32", accumulation_length(header), 2)  # the fixture's 2 layers
    assert s.max_relative_error < 0.1 * s.tolerance
    assert p.dtype == "int8" and p.ok and not p.ties_capped  # int8's step makes its near-ties, not the conversion


@pytest.mark.parametrize("amount", [1.1, 1.01])
def test_an_int4_builds_scale_defect_is_refused_by_structure(amount, int4, tmp_path):
    bad = tmp_path / "paged.onnx"
    onnx.save(defects.inject("scale", onnx.load(str(int4[0])), amount), str(bad))
    with pytest.raises(ConversionError) as err:
        verify_conversion(INT4, bad)
    text = str(err.value)
    assert "does not match the original (structure)" in text and "structure (float32 twin)" in text, text


def _model(*ops: str) -> onnx.ModelProto:
    nodes = [
        helper.make_node(
            "MatMulNBits",
            ["x", "w", "s"],
            ["y"],
            domain="com.microsoft",
            K=8,
            N=8,
            bits=4,
            block_size=16,
            accuracy_level=4,
        )
        if op == "MatMulNBits"
        else helper.make_node(op, ["x"], ["y", "ys", "yz"])
        for op in ops
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])], [])
    return helper.make_model(graph)


def test_the_switch_changes_both_sides_or_neither():
    a, b = _model("MatMulNBits"), _model("MatMulNBits")
    assert switch_to_float32_activations(a, b)
    assert not int8_activation_matmuls(a) and not int8_activation_matmuls(b)
    # dynamic quantization has no switch: nothing changes on either side
    c, d = _model("MatMulNBits"), _model("MatMulNBits", "DynamicQuantizeLinear")
    assert not switch_to_float32_activations(c, d)
    assert int8_activation_matmuls(c) and int8_activation_matmuls(d)
    assert not switch_to_float32_activations(_model("MatMulNBits"), _model())  # one side has none
