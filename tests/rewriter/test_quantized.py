"""Quantized weights (MatMulNBits): untouched where the rewrite does not need them, absorbed exactly in MLA."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.parity import FIXTURES, paged_nodes, run_parity

from ortpa.rewriter.pipeline import convert


def _quantize(model: onnx.ModelProto, *, symmetric: bool = True, accuracy_level: int = 0) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(model, block_size=32, is_symmetric=symmetric, accuracy_level=accuracy_level)
    q.process()
    return q.model.model


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("k", [64, 80])  # 80: the last block is padded
def test_dequantized_weight_is_what_onnxruntime_multiplies_by(symmetric, k):
    import onnx_ir as ir

    from ortpa.rewriter.quantized import dequantized_weight

    rng = np.random.default_rng(k + symmetric)
    w = rng.standard_normal((k, 48)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"])],
        "mm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 48])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    dense = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    dense.ir_version = 10
    model = _quantize(dense, symmetric=symmetric)
    node = next(n for n in ir.serde.deserialize_model(model).graph if n.op_type == "MatMulNBits")
    deq = dequantized_weight(node)
    assert deq is not None and deq.shape == (k, 48)
    a = rng.standard_normal((3, k)).astype(np.float32)
    (y,) = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})
    np.testing.assert_allclose(a @ deq, y, rtol=1e-5, atol=1e-5)
    assert np.abs(deq - w).max() < 0.5 * np.abs(w).max()  # a 4-bit approximation of w, not something else


@pytest.mark.parametrize("accuracy_level", [0, 4])
def test_mla_with_quantized_kv_b_proj(accuracy_level, tmp_path: Path):
    """Every projection int4; kv_b_proj is dequantized and absorbed, every other MatMulNBits is kept as it is.

    accuracy_level 0 (float activations) must match at the float16 tolerance, which shows the dequantization
    is exact; at 4 the original quantizes kv_b_proj's input (the cached latent) to int8 and the absorbed path
    does not, so the int8-activation tolerance applies.
    """
    original = _quantize(onnx.load(str(FIXTURES / "dsv3_sdpa_op18.onnx")), accuracy_level=accuracy_level)
    path = tmp_path / "dsv3_int4.onnx"
    onnx.save(original, str(path))
    paged = convert(path)
    before = sum(n.op_type == "MatMulNBits" for n in original.graph.node)
    after = sum(n.op_type == "MatMulNBits" for n in paged.graph.node)
    assert len(paged_nodes(paged)) == 2 and after == before - 2  # only the two kv_b_proj
    # accuracy_level 4 quantizes activations to int8: the coarsest arithmetic the float16 rounding feeds
    result = run_parity(paged, path, steps=8, dtype="int8" if accuracy_level else np.float16)
    assert result.tokens_checked == 24
    if not accuracy_level:
        assert result.near_ties <= 2


@pytest.mark.parametrize("fixture", ["dsv3_sdpa_op18", "llama_sdpa_op18"])
def test_bfloat16_conversion_of_a_float32_export_is_a_valid_model(fixture):
    """``dtype="bfloat16"``: a model for CUDA (ONNX Runtime's CPU has no bfloat16 arithmetic, so meant for CPU
    as well it is refused, naming an op). RoPE's positions times frequencies and its Sin / Cos stay float32 (index
    arithmetic; Sin / Cos take no bfloat16 at opset 18 anyway); the result passes onnx.checker and the CUDA
    validation."""
    from ortpa.errors import ConversionError
    from ortpa.ops.validate import validate

    with pytest.raises(ConversionError, match=r"cannot run on CPU: ONNX Runtime has no bfloat16 kernel for \w+"):
        convert(FIXTURES / f"{fixture}.onnx", dtype="bfloat16")
    paged = convert(FIXTURES / f"{fixture}.onnx", dtype="bfloat16", providers=("cuda",))
    onnx.checker.check_model(paged)
    assert validate(paged, backend="cuda").ok
    inferred = onnx.shape_inference.infer_shapes(paged)
    types = {v.name: v.type.tensor_type.elem_type for v in [*inferred.graph.value_info, *inferred.graph.input]}
    trig = [n for n in paged.graph.node if n.op_type in ("Sin", "Cos")]
    assert trig and all(types[n.input[0]] == TensorProto.FLOAT for n in trig)
