"""ALiBi (a per-head position bias on the attention scores) is refused by name, in every form an export gives it,
before anything else about the layer is checked; and a checkpoint that uses it is refused from its config.json
before any export work. Each form is a one-layer graph built here, beside the same graph without the bias."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import ortpa
from ortpa.errors import UnsupportedModel
from ortpa.model.position_bias import config_position_bias
from ortpa.rewriter.layer import LayerFailure
from ortpa.rewriter.recognisers import recognise_separate_layers

H, D, T, P = 4, 8, 3, 5  # heads, head size, new tokens, past tokens
L = T + P
F = TensorProto.FLOAT
SLOPES = np.array([2.0 ** (-8 * (h + 1) / H) for h in range(H)], np.float32)  # ALiBi's slopes for 4 heads


def _graph(nodes, inputs, outputs, inits) -> ir.Graph:
    model = helper.make_model(
        helper.make_graph(nodes, "layer", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", 18)]
    )
    return ir.from_proto(model).graph


def _four_d(bias: str) -> ir.Graph:
    """[B, H, S, D] caches, MatMul(q, k^T) * scale (+ bias) + mask -> Softmax -> MatMul(p, v). ``bias``: "table"
    (a constant [1, H, 1, 16] sliced to the key length, MPT's attn_bias), "zeros" (the same constant, no bias),
    "mask_heads" (a float mask input [B, H, T, L]: ALiBi folded into the mask), "mask" ([B, 1, T, L])."""
    inputs = [
        helper.make_tensor_value_info("past_key_values.0.key", F, [1, H, P, D]),
        helper.make_tensor_value_info("past_key_values.0.value", F, [1, H, P, D]),
        helper.make_tensor_value_info("q", F, [1, H, T, D]),
        helper.make_tensor_value_info("k", F, [1, H, T, D]),
        helper.make_tensor_value_info("v", F, [1, H, T, D]),
        helper.make_tensor_value_info("mask", F, [1, H if bias == "mask_heads" else 1, T, L]),
    ]
    inits = [numpy_helper.from_array(np.array(D**-0.5, np.float32), "scale")]
    nodes = [
        helper.make_node("Concat", ["past_key_values.0.key", "k"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "v"], ["present.0.value"], axis=2),
        helper.make_node("Transpose", ["present.0.key"], ["kt"], perm=[0, 1, 3, 2]),
        helper.make_node("MatMul", ["q", "kt"], ["qk"]),
        helper.make_node("Mul", ["qk", "scale"], ["scaled"]),
    ]
    scores = "scaled"
    if bias in ("table", "zeros"):
        table = SLOPES[None, :, None, None] * np.arange(16, dtype=np.float32)[None, None, None, :]
        inits += [
            numpy_helper.from_array(table if bias == "table" else np.zeros_like(table), "attn_bias"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array([3], np.int64), "last_axis"),
            numpy_helper.from_array(np.array([2], np.int64), "two"),
            numpy_helper.from_array(np.array([3], np.int64), "three"),
        ]
        nodes += [
            helper.make_node("Shape", ["present.0.key"], ["key_len"], start=2, end=3),
            helper.make_node("Slice", ["attn_bias", "zero", "key_len", "last_axis"], ["bias"]),
            helper.make_node("Add", ["scaled", "bias"], ["biased"]),
        ]
        scores = "biased"
    nodes += [
        helper.make_node("Add", [scores, "mask"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
        helper.make_node("MatMul", ["p", "present.0.value"], ["out"]),
    ]
    outputs = [
        helper.make_tensor_value_info("out", F, [1, H, T, D]),
        helper.make_tensor_value_info("present.0.key", F, [1, H, L, D]),
        helper.make_tensor_value_info("present.0.value", F, [1, H, L, D]),
    ]
    return _graph(nodes, inputs, outputs, inits)


def _bmm_3d(alibi: bool) -> ir.Graph:
    """BLOOM's form: caches [B * H, D, S] (key) and [B * H, S, D] (value), ``baddbmm(alibi, q, k)`` with ALiBi
    from the attention mask's CumSum times per-head slopes, viewed 4-D for ``masked_fill`` (Where), Softmax, viewed
    3-D again for ``bmm(p, v)``."""
    inputs = [
        helper.make_tensor_value_info("past_key_values.0.key", F, [H, D, P]),
        helper.make_tensor_value_info("past_key_values.0.value", F, [H, P, D]),
        helper.make_tensor_value_info("q", F, [H, T, D]),
        helper.make_tensor_value_info("k", F, [H, D, T]),
        helper.make_tensor_value_info("v", F, [H, T, D]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [1, L]),
        helper.make_tensor_value_info("causal", TensorProto.BOOL, [1, 1, T, L]),
    ]
    inits = [
        numpy_helper.from_array(np.array(D**-0.5, np.float32), "alpha"),
        numpy_helper.from_array(SLOPES.reshape(H, 1), "slopes"),
        numpy_helper.from_array(np.array(1, np.int64), "axis1"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([H, 1, L], np.int64), "alibi_shape"),
        numpy_helper.from_array(np.array([1, H, T, L], np.int64), "four_d"),
        numpy_helper.from_array(np.array([H, T, L], np.int64), "three_d"),
        numpy_helper.from_array(np.array(-3.4e38, np.float32), "lowest"),
    ]
    nodes = [
        helper.make_node("Concat", ["past_key_values.0.key", "k"], ["present.0.key"], axis=2),
        helper.make_node("Concat", ["past_key_values.0.value", "v"], ["present.0.value"], axis=1),
        helper.make_node("MatMul", ["q", "present.0.key"], ["qk"]),
        helper.make_node("Mul", ["qk", "alpha"], ["scaled"]),
    ]
    scores = "scaled"
    if alibi:
        nodes += [
            helper.make_node("CumSum", ["attention_mask", "axis1"], ["cum"]),
            helper.make_node("Sub", ["cum", "one"], ["pos"]),
            helper.make_node("Cast", ["pos"], ["posf"], to=F),
            helper.make_node("Mul", ["slopes", "posf"], ["alibi"]),
            helper.make_node("Reshape", ["alibi", "alibi_shape"], ["alibi3"]),
            helper.make_node("Add", ["scaled", "alibi3"], ["biased"]),
        ]
        scores = "biased"
    nodes += [
        helper.make_node("Reshape", [scores, "four_d"], ["s4"]),
        helper.make_node("Where", ["causal", "s4", "lowest"], ["masked"]),
        helper.make_node("Softmax", ["masked"], ["p4"], axis=-1),
        helper.make_node("Reshape", ["p4", "three_d"], ["p"]),
        helper.make_node("MatMul", ["p", "present.0.value"], ["out"]),
    ]
    outputs = [helper.make_tensor_value_info(n, F, None) for n in ("out", "present.0.key", "present.0.value")]
    return _graph(nodes, inputs, outputs, inits)


@pytest.mark.parametrize(
    ("graph", "said"),
    [
        (lambda: _four_d("table"), "holds a per-head linear position bias"),
        (lambda: _four_d("mask_heads"), "has a heads axis of 4"),
        (lambda: _bmm_3d(alibi=True), "scales positions by per-head slopes"),
    ],
    ids=["separate-bias-table", "folded-into-a-float-mask", "bmm-over-3d-caches"],
)
def test_every_form_of_alibi_is_refused_by_name(graph, said):
    with pytest.raises(UnsupportedModel, match="ALiBi") as refused:
        recognise_separate_layers(graph())
    assert "layer 0" in str(refused.value) and said in str(refused.value), refused.value
    assert not refused.value.mixes_sequences


@pytest.mark.parametrize(
    "graph",
    [lambda: _four_d("zeros"), lambda: _four_d("mask"), lambda: _bmm_3d(alibi=False)],
    ids=["a-zero-table", "a-mask-for-every-head", "bmm-without-alibi"],
)
def test_the_same_layers_without_a_bias_are_not_called_alibi(graph):
    (result,) = recognise_separate_layers(graph())  # matched, or refused for what it is: never as ALiBi
    assert not isinstance(result, LayerFailure) or "ALiBi" not in result.reason


@pytest.mark.parametrize(
    ("config", "alibi"),
    [
        ({"model_type": "bloom"}, True),
        ({"model_type": "falcon", "alibi": True}, True),
        ({"model_type": "falcon", "alibi": False}, False),
        ({"model_type": "mpt", "attn_config": {"alibi": True}}, True),
        ({"model_type": "mpt", "attn_config": {"alibi": False}}, False),
        ({"model_type": "jais", "position_embedding_type": "alibi"}, True),
        ({"model_type": "llama", "rope_theta": 10000.0}, False),
    ],
)
def test_config_json_says_alibi(config, alibi):
    assert (config_position_bias(config) is not None) == alibi


def test_an_alibi_checkpoint_is_refused_before_any_export(tmp_path, monkeypatch):
    import ortpa.conversion.orchestrator as orchestrator

    exported: list = []
    monkeypatch.setattr(orchestrator, "export_dense", lambda *a, **k: exported.append(a))
    checkpoint = tmp_path / "bloom"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "bloom", "n_head": 4, "torch_dtype": "float32"}))
    out = tmp_path / "out" / "model.onnx"
    with pytest.raises(UnsupportedModel, match=r"ALiBi; config\.json: model_type 'bloom'"):
        ortpa.convert_file(checkpoint, out)
    assert exported == [] and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bloom"]  # no staging, no dense folder left behind


def test_an_onnx_graph_with_alibi_in_a_file_is_refused_by_convert(tmp_path):
    """Through the whole conversion: nothing is written, and the message names ALiBi."""
    proto = ir.to_proto(ir.Model(_four_d("mask_heads"), ir_version=10))
    src = tmp_path / "dense.onnx"
    onnx.save(proto, src)
    with pytest.raises(UnsupportedModel, match="ALiBi"):
        ortpa.convert(str(src), providers=())
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == ["dense.onnx"]
