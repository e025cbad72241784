"""Dense MLA -> PagedAttention LATENT: parity of converted fixtures against the dense exports on ORT CPU.

Parity runs through :func:`parity.run_parity` (the converted model on a ``PagedSession``, PagedAttention
lowered to ``ortpa.ops.portable``; the reference is the dense export one sequence at a time), in its strict
form: greedy tokens equal at every step, blocks handed out in a scattered order.
"""

from __future__ import annotations

import hashlib

import numpy as np
import onnx
import pytest
from support.parity import FIXTURES, attrs, check_near_miss, near_miss, run_parity

from ortpa.conversion import convert_file
from ortpa.errors import ConversionError
from ortpa.ops.validate import validate_model
from ortpa.rewriter.layer import LayerFailure, MlaLayer
from ortpa.rewriter.pipeline import convert
from ortpa.rewriter.recognisers.mla import match_mla_layers


def _run_paged(converted: onnx.ModelProto, dense_path, *, logits: str = "last", positions: bool = False):
    """Continuous batching vs the dense model, strict: greedy tokens always equal, scattered block tables.

    ``positions``: whether the converted model takes ``position_ids`` (``run_parity`` feeds what it declares).
    """
    assert ("position_ids" in {i.name for i in converted.graph.input}) == positions
    return run_parity(converted, dense_path, allow_ties=False, scatter_blocks=True, logits=logits)


# (fixture, convert options, harness options): each real export, plus the option matrix on the headline one.
CASES = [
    ("dsv3_sdpa_op18", {}, {}),
    ("dsv3_eager_op18", {}, {}),
    ("dsv3_sdpa_op23", {}, {}),
    ("dsv3_sdpa_op18", {"rope_in_op": True}, {}),
    ("dsv3_sdpa_op18_noil_noqlora", {"absorb": "matmul"}, {}),
    ("dsv3_sdpa_op18_noil_noqlora", {"rope_in_op": True}, {}),
    ("dsv3_sdpa_op18_rope32", {"rope_in_op": True, "absorb": "matmul"}, {}),
    ("kimi_sdpa_op18", {"absorb": "fold", "logits": "all"}, {"logits": "all"}),
    ("glm4moelite_sdpa_op18", {"position_ids": "input", "attention_metadata": True}, {"positions": True}),
    ("minicpm3_sdpa_op18", {}, {}),
]


@pytest.mark.parametrize(("fixture", "options", "harness"), CASES, ids=[c[0] + str(c[1] or "") for c in CASES])
def test_parity_continuous_batching(fixture, options, harness):
    dense_path = FIXTURES / f"{fixture}.onnx"
    converted = convert(str(dense_path), **options)
    assert sum(n.op_type == "PagedAttention" for n in converted.graph.node) == 2
    _run_paged(converted, dense_path, **harness)


def test_wrong_scale_breaks_parity():
    """The parity harness can fail: a 10% error in the absorbed softmax scale is caught."""
    converted = convert(str(FIXTURES / "dsv3_sdpa_op18.onnx"))
    for node in converted.graph.node:
        for attr in node.attribute:
            if node.op_type == "PagedAttention" and attr.name == "scale":
                attr.f *= 1.1
    with pytest.raises(AssertionError):
        _run_paged(converted, FIXTURES / "dsv3_sdpa_op18.onnx")


def test_node_attributes_and_interface():
    converted = convert(str(FIXTURES / "dsv3_sdpa_op18.onnx"))
    nodes = [n for n in converted.graph.node if n.op_type == "PagedAttention"]
    a = attrs(nodes[0])
    assert a["kv_cache_layout"] == b"LATENT" and a["kv_num_heads"] == 1 and a["num_heads"] == 4
    assert a["v_head_size"] == 64  # kv_lora_rank
    # 1/sqrt(qk_nope + qk_rope) * mscale(4, 1)^2, not 1/sqrt(head_size = 80)
    mscale = 0.1 * np.log(4.0) + 1.0
    assert a["scale"] == pytest.approx(mscale**2 / np.sqrt(48), rel=1e-6)
    assert "do_rotary" not in a
    names = [i.name for i in converted.graph.input]
    assert names == [
        "input_ids",
        "cumulative_sequence_lengths",
        "past_sequence_lengths",
        "block_table",
        "attention_metadata",
        "past_key_values.0.key",
        "past_key_values.1.key",
        "logits_indices",  # optional, with a default
    ]
    assert [o.name for o in converted.graph.output] == ["logits", "present.0.key", "present.1.key"]
    assert nodes[0].input[3] == "past_key_values.0.key"
    # the fresh prompts' rows (expanded prefill) join the node's own write before the cache leaves the graph
    (write,) = [n for n in converted.graph.node if nodes[0].output[1] in n.input]
    assert write.op_type == "ScatterND" and write.input[0] == nodes[0].output[1] and write.output[0] == "present.0.key"
    cache = converted.graph.input[5].type.tensor_type
    assert cache.elem_type == onnx.TensorProto.FLOAT16
    assert [d.dim_value or d.dim_param for d in cache.shape.dim] == ["num_blocks", "block_size", 1, 80]
    assert validate_model(converted, backend="cuda").ok


def test_rope_in_op_attributes():
    converted = convert(str(FIXTURES / "dsv3_sdpa_op18_rope32.onnx"), rope_in_op=True, max_positions=128)
    node = next(n for n in converted.graph.node if n.op_type == "PagedAttention")
    a = attrs(node)
    assert (a["do_rotary"], a["rotary_offset"], a["rotary_interleaved"]) == (1, 64, 1)
    cast = next(n for n in converted.graph.node if n.output[0] == node.input[8])  # float32, cast to T in the graph
    assert cast.op_type == "Cast" and attrs(cast)["to"] == onnx.TensorProto.FLOAT16
    cos = next(i for i in converted.graph.initializer if i.name == cast.input[0])
    assert list(cos.dims) == [128, 16] and cos.data_type == onnx.TensorProto.FLOAT
    assert "position_ids" not in {i.name for i in converted.graph.input}
    assert not any(n.op_type in ("Cos", "Sin") for n in converted.graph.node)  # the graph's RoPE is gone


def test_dtype_float16_and_bfloat16_cache():
    fp16 = convert(str(FIXTURES / "dsv3_sdpa_op18.onnx"), dtype="float16")
    # float32 stays only where integers are computed through floats (RoPE's positions times its frequencies)
    kept = [i for i in fp16.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert all(len(i.raw_data or b"") <= 64 * 4 and "weight" not in i.name for i in kept), [i.name for i in kept]
    assert sum(i.data_type == onnx.TensorProto.FLOAT16 and len(i.raw_data) > 4096 for i in fp16.graph.initializer)
    assert fp16.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert not any(
        n.op_type == "Cast" and n.output[0] in {x for p in fp16.graph.node for x in p.input[:2]}
        for n in fp16.graph.node
        if n.op_type == "PagedAttention"
    )
    bf16 = convert(str(FIXTURES / "dsv3_sdpa_op18.onnx"), kv_cache_dtype="bfloat16")
    cache = next(i for i in bf16.graph.input if i.name == "past_key_values.0.key")
    assert cache.type.tensor_type.elem_type == onnx.TensorProto.BFLOAT16
    assert validate_model(bf16, backend="cuda").ok


def _near_miss() -> onnx.ModelProto:
    return near_miss("dsv3_sdpa_op18")


def test_near_miss_is_reported_and_left_alone():
    check_near_miss(_near_miss(), "1 of 2 layers", match_mla_layers, MlaLayer, LayerFailure)


def test_not_mla_is_rejected():
    x = onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["b", "s"])
    y = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.INT64, ["b", "s"])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["input_ids"], ["logits"])], "g", [x], [y])
    # ir_version / opset that ONNX Runtime loads: helper.make_model's defaults are newer than ORT 1.31 accepts,
    # and convert refuses those up front (tests/test_hostile_files.py)
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 18)], ir_version=10)
    with pytest.raises(ConversionError, match="no attention layers found"):
        convert(model)


def test_convert_file_is_atomic(tmp_path):
    src = FIXTURES / "dsv3_sdpa_op18.onnx"
    digest = hashlib.sha256(src.read_bytes()).hexdigest()
    out = tmp_path / "sub" / "paged.onnx"
    convert_file(src, out)
    assert hashlib.sha256(src.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in out.parent.iterdir()) == ["genai_config.json", "paged.onnx"]  # no temp files
    assert sum(n.op_type == "PagedAttention" for n in onnx.load(str(out)).graph.node) == 2
    bad = tmp_path / "near_miss.onnx"
    onnx.save(_near_miss(), str(bad))
    with pytest.raises(ConversionError):
        convert_file(bad, tmp_path / "never.onnx")
    assert not (tmp_path / "never.onnx").exists()
    with pytest.raises(ConversionError, match="overwrite the input"):
        convert_file(bad, bad)


def test_external_data_over_threshold(tmp_path, monkeypatch):
    """Models over protobuf's 2 GB limit are saved with external data (threshold lowered to exercise it)."""
    import ortpa.rewriter.model_store as model_store

    monkeypatch.setattr(model_store, "EXTERNAL_DATA_THRESHOLD", 1)
    out = tmp_path / "paged.onnx"
    convert_file(FIXTURES / "dsv3_sdpa_op18.onnx", out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["genai_config.json", "paged.onnx", "paged.onnx.data"]
    assert out.stat().st_size < (tmp_path / "paged.onnx.data").stat().st_size
    assert sum(n.op_type == "PagedAttention" for n in onnx.load(str(out)).graph.node) == 2
