"""onnx shape inference taught PagedAttention's output rule propagates shapes past the op."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ortpa.ops.shape_inference import infer_shapes


def _model(attrs: dict, *, query_width: int, key: bool = True, layout_latent: bool = False) -> onnx.ModelProto:
    kv_w = 40
    inputs = [helper.make_tensor_value_info("q", TensorProto.FLOAT16, ["T", query_width])]
    names = ["q"]
    if key:
        inputs.append(helper.make_tensor_value_info("k", TensorProto.FLOAT16, ["T", kv_w]))
        names.append("k")
        if not layout_latent:
            inputs.append(helper.make_tensor_value_info("v", TensorProto.FLOAT16, ["T", kv_w]))
            names.append("v")
        else:
            names.append("")
    else:
        names += ["", ""]
    inputs.append(helper.make_tensor_value_info("kc", TensorProto.FLOAT16, ["NB", 16, 1, 8]))
    names += ["kc", "", "cu", "past", "bt"]
    inputs += [
        helper.make_tensor_value_info("cu", TensorProto.INT32, ["B1"]),
        helper.make_tensor_value_info("past", TensorProto.INT32, ["B"]),
        helper.make_tensor_value_info("bt", TensorProto.INT32, ["B", "M"]),
    ]
    nodes = [
        helper.make_node("PagedAttention", names, ["attn", "kc_out"], domain="com.microsoft", **attrs),
        helper.make_node("Relu", ["attn"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT16, None)])
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )


def _shape(model: onnx.ModelProto, name: str):
    for vi in [*model.graph.value_info, *model.graph.output]:
        if vi.name == name:
            return [d.dim_value or d.dim_param for d in vi.type.tensor_type.shape.dim]
    return None


def test_separate_output_keeps_query_width_and_flows_downstream():
    m = infer_shapes(_model({"num_heads": 8, "kv_num_heads": 5}, query_width=64))
    assert _shape(m, "attn") == ["T", 64]
    assert _shape(m, "y") == ["T", 64]
    assert _shape(m, "kc_out") == ["NB", 16, 1, 8]


def test_latent_output_is_num_heads_times_v_head_size():
    attrs = {"num_heads": 4, "kv_num_heads": 1, "kv_cache_layout": "LATENT", "v_head_size": 24, "scale": 0.1}
    m = infer_shapes(_model(attrs, query_width=4 * 40, layout_latent=True))
    assert _shape(m, "attn") == ["T", 96]


def test_packed_qkv_output_is_the_query_part():
    m = infer_shapes(_model({"num_heads": 4, "kv_num_heads": 2}, query_width=(4 + 2 * 2) * 16, key=False))
    assert _shape(m, "attn") == ["T", 64]


def test_schemas_are_registered_on_first_use_not_at_import():
    """Importing ortpa leaves onnx's global schema registry alone; the one registration adds ortpa's ops, and a
    second call is harmless."""
    import subprocess
    import sys

    code = (
        "import onnx.defs, ortpa, ortpa.ops.portable, ortpa.cli\n"
        "from ortpa.ops.shape_inference import register_schemas\n"
        "def known(): return [onnx.defs.has('PagedAttention', 'com.microsoft'), "
        "onnx.defs.has('SimplifiedLayerNormalization')]\n"
        "before = known(); register_schemas(); register_schemas(); print(before, known())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[False, False] [True, True]"


def test_failed_inference_is_logged_at_debug(monkeypatch, caplog):
    """Non-strict inference that fails keeps the model and says why at debug level (never silently)."""
    import logging

    import onnx

    from ortpa.ops.shape_inference import infer_shapes

    def fail(*args, **kwargs):
        raise ValueError("too big for the test")

    model = onnx.helper.make_model(onnx.helper.make_graph([], "empty", [], []))
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", fail)
    with caplog.at_level(logging.DEBUG, logger="ortpa.ops.shape_inference"):
        assert infer_shapes(model) is model
    assert any("ValueError: too big for the test" in r.getMessage() for r in caplog.records), caplog.records
