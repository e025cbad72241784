"""The ONNX LLMs people already have, made by the tools they use (``tests/fixtures/formats/``), convert with parity.

Each fixture is converted by :func:`ortpa.convert`, validated for the CUDA backend, and driven with continuous
batching (3 sequences of different lengths prefilled together, then 8 packed decode steps with one sequence
leaving and one joining) on the portable op; every row is compared with the original model run alone by ONNX
Runtime in its own format (:func:`ortpa.parity.greedy.open_dense`: genai: ``attention_mask`` only, or with
``position_ids``; optimum: ``attention_mask`` + ``position_ids``; OnnxExporter: no mask, its own cache names).
Near misses of each form are refused, by layer, with the reason.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from support.parity import paged_nodes, run_parity

from ortpa.errors import ConversionError
from ortpa.ops.validate import validate
from ortpa.rewriter.pipeline import convert

FORMATS = Path(__file__).resolve().parents[1] / "fixtures" / "formats"

# fixture -> (recogniser that must have described its layers, the deployed precision: the cache's float16, or
# int8 where the original quantizes activations to int8 and the float16 rounding feeds that quantizer)
CASES = {
    "genai_llama_fp32": ("GroupQueryAttention", "float16"),
    "genai_qwen3_fp32": ("GroupQueryAttention", "float16"),
    "genai_llama_fp16": ("MultiHeadAttention", "float16"),
    "genai_qwen3_fp16": ("MultiHeadAttention", "float16"),
    "genai_llama_int4": ("GroupQueryAttention", "int8"),
    "genai_qwen3_int4": ("GroupQueryAttention", "int8"),
    "genai_gemma2_fp32": ("GroupQueryAttention", "float16"),
    "optimum_llama": ("decomposed", "float16"),
    "optimum_qwen3": ("decomposed", "float16"),
    "onnxexporter_llama": ("decomposed", "float16"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_format_converts_with_parity(name, tmp_path):
    source_op, precision = CASES[name]
    paged = convert(FORMATS / f"{name}.onnx")
    nodes = paged_nodes(paged)
    assert len(nodes) == 2
    report = validate(paged, backend="cuda")
    assert report.ok, report.format()
    ops = {n.op_type for n in paged.graph.node}
    assert ops.isdisjoint({"GroupQueryAttention", "MultiHeadAttention", "Softmax"})
    if "int4" in name:  # the quantized projections are left as they are
        original = onnx.load(str(FORMATS / f"{name}.onnx"))
        count = sum(n.op_type == "MatMulNBits" for n in original.graph.node)
        assert count and sum(n.op_type == "MatMulNBits" for n in paged.graph.node) == count
    result = run_parity(paged, FORMATS / f"{name}.onnx", steps=8, dtype=precision)
    assert result.tokens_checked == 24 and result.max_context >= 18
    if precision == "float16":
        assert result.near_ties <= 2, f"{result.near_ties} greedy steps within the tie margin"
    assert source_op  # documented per case: which recogniser applies (checked in test_recogniser_per_format)


@pytest.mark.parametrize("name", sorted(CASES))
def test_recogniser_per_format(name):
    import onnx_ir as ir

    from ortpa.rewriter.recognisers import recognise_separate_layers
    from ortpa.rewriter.recognisers.caches import canonicalise_cache_io

    model = ir.load(str(FORMATS / f"{name}.onnx"))
    canonicalise_cache_io(model.graph)
    layers = recognise_separate_layers(model.graph)
    assert [getattr(m, "source", None) for m in layers] == [CASES[name][0]] * 2, layers
    assert all(m.head_size in (16, 32) and m.num_heads == 4 and m.kv_num_heads == 2 for m in layers)


def _refused_at_layer_1(model: onnx.ModelProto, reason: str) -> None:
    """``convert`` refuses the model, naming layer 1 only, with ``reason`` in its words."""
    with pytest.raises(ConversionError) as info:
        convert(model, providers=())
    (where, why), *rest = info.value.failures
    assert not rest and where.startswith("layer 1") and reason in why, info.value.failures


def _gqa_node(model: onnx.ModelProto, layer: int) -> onnx.NodeProto:
    return [n for n in model.graph.node if n.op_type == "GroupQueryAttention"][layer]


def test_genai_near_miss_reported_by_layer():
    model = onnx.load(str(FORMATS / "genai_llama_fp32.onnx"))
    _gqa_node(model, 1).attribute.append(onnx.helper.make_attribute("qk_output", 1))
    _refused_at_layer_1(model, "qk_output")


def test_optimum_near_miss_reported_by_layer():
    model = onnx.load(str(FORMATS / "optimum_llama.onnx"))
    softmaxes = [n for n in model.graph.node if n.op_type == "Softmax"]
    softmaxes[1].op_type = "Sigmoid"
    del softmaxes[1].attribute[:]
    _refused_at_layer_1(model, "not a Softmax")


def test_symbolic_heads_come_from_the_projection():
    """optimum leaves query heads symbolic (Reshape to Concat(batch, seq, -1, head)); ortpa derives them from
    the q_proj weight width: a different width (6 heads' worth) gives 6 heads, not a copy of the cache's 2."""
    import onnx_ir as ir

    from ortpa.rewriter.recognisers import recognise_separate_layers

    model = ir.load(str(FORMATS / "optimum_llama.onnx"))
    (m0, _) = recognise_separate_layers(model.graph)
    q_proj = next(n for n in model.graph if n.name == "/model/layers.0/self_attn/q_proj/MatMul")
    assert m0.query.shape is None or not isinstance(m0.query.shape[1], int)  # symbolic in the graph itself
    assert m0.num_heads * m0.head_size == np.asarray(q_proj.inputs[1].const_value.numpy()).shape[-1] == 64
    assert (m0.num_heads, m0.kv_num_heads) == (4, 2)


def test_genai_fp16_mask_that_is_not_attention_mask_is_refused():
    """MultiHeadAttention whose attention_bias is a constant (a bias, not padding/causality from
    attention_mask): dropping it would change the result, so layer 1 is refused with the reason."""
    model = onnx.load(str(FORMATS / "genai_llama_fp16.onnx"))
    node = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"][1]
    bias = onnx.numpy_helper.from_array(np.zeros((1, 4, 1, 1), np.float16), "constant_bias")
    model.graph.initializer.append(bias)
    node.input[5] = "constant_bias"
    _refused_at_layer_1(model, "more than attention_mask")


def test_onnx_exporter_near_miss_reported_by_layer():
    model = onnx.load(str(FORMATS / "onnxexporter_llama.onnx"))
    softmaxes = [n for n in model.graph.node if n.op_type == "Softmax"]
    assert len(softmaxes) == 2
    softmaxes[1].op_type = "Sigmoid"
    del softmaxes[1].attribute[:]
    _refused_at_layer_1(model, "not a Softmax")
