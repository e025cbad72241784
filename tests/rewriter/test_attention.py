"""Dense MHA / GQA -> PagedAttention SEPARATE: conversion of real transformers exports, and parity on ORT CPU.

Fixtures (``scripts/make_fixtures_mha.py``): Llama GQA (sdpa opset 18, ONNX ``Attention`` at opset 23), Llama
MHA (eager), Qwen3 (q/k RMSNorm), Qwen2 with a 4-token sliding window on layer 1 only, Gemma-2 (softcap,
non-default scale, alternating sliding layers). Each converts, passes ortpa's CUDA node validation, and matches
the dense export through :func:`parity.run_parity` (prefill of 3 sequences together, 7 continuously batched
steps, contexts up to 18 tokens: well past the window).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.configs import TINY_LLAMA
from support.parity import FIXTURES, attrs, check_near_miss, near_miss, paged_nodes, run_parity

from ortpa.errors import ConversionError
from ortpa.ops.validate import validate_model
from ortpa.rewriter.layer import AttentionLayer, LayerFailure
from ortpa.rewriter.pipeline import convert
from ortpa.rewriter.recognisers.decomposed import match_attention_layers

# (fixture, convert options)
CASES = [
    ("llama_sdpa_op18", {}),
    ("llama_sdpa_op18", {"rope_in_op": True}),
    ("llama_mha_eager_op18", {}),
    ("llama_sdpa_op23", {}),
    ("llama_sdpa_op23", {"rope_in_op": True}),
    ("qwen3_sdpa_op18", {}),
    ("qwen3_sdpa_op18", {"rope_in_op": True}),
    ("qwen2_sliding_sdpa_op18", {}),
    ("qwen2_sliding_sdpa_op18", {"rope_in_op": True, "logits": "all"}),
    ("gemma2_eager_op18", {}),
]


@pytest.mark.parametrize(("fixture", "options"), CASES, ids=[c[0] + str(c[1] or "") for c in CASES])
def test_parity_continuous_batching(fixture, options):
    dense = FIXTURES / f"{fixture}.onnx"
    converted = convert(str(dense), **options)
    nodes = paged_nodes(converted)
    assert len(nodes) == 2 and all(attrs(n)["kv_cache_layout"] == b"SEPARATE" for n in nodes)
    report = validate_model(converted, backend="cuda")
    assert report.ok, report.format()
    result = run_parity(converted, dense)
    assert result.tokens_checked == 24 and result.max_context >= 17


def test_interface_and_attributes():
    converted = convert(str(FIXTURES / "llama_sdpa_op18.onnx"))
    assert [i.name for i in converted.graph.input] == [
        "input_ids",
        "cumulative_sequence_lengths",
        "past_sequence_lengths",
        "block_table",
        "attention_metadata",
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.key",
        "past_key_values.1.value",
        "logits_indices",  # optional: its default (an initializer) asks for each sequence's last row
    ]
    assert "logits_indices" in {i.name for i in converted.graph.initializer}
    assert [o.name for o in converted.graph.output] == [
        "logits",
        "present.0.key",
        "present.0.value",
        "present.1.key",
        "present.1.value",
    ]
    node = paged_nodes(converted)[0]
    assert list(node.input[3:5]) == ["past_key_values.0.key", "past_key_values.0.value"]
    assert list(node.output[1:]) == ["present.0.key", "present.0.value"]
    a = attrs(node)
    # 1/sqrt(head) is the op's default: not written; RoPE stays in the graph by default
    assert (a["num_heads"], a["kv_num_heads"]) == (4, 2) and "scale" not in a and "do_rotary" not in a
    cache = converted.graph.input[5].type.tensor_type
    assert cache.elem_type == onnx.TensorProto.FLOAT16
    assert [d.dim_value or d.dim_param for d in cache.shape.dim] == ["num_blocks", "block_size", 2, 16]
    assert converted.metadata_props[0].key and any(
        p.key == "ortpa.converted" and p.value == "paged-attention-separate" for p in converted.metadata_props
    )
    assert not any(n.op_type == "Softmax" for n in converted.graph.node)  # the dense attention is gone


def test_sliding_window_softcap_and_scale_per_layer():
    qwen2 = [attrs(n) for n in paged_nodes(convert(str(FIXTURES / "qwen2_sliding_sdpa_op18.onnx")))]
    assert "local_window_size" not in qwen2[0] and qwen2[1]["local_window_size"] == 4  # max_window_layers=1
    gemma = [attrs(n) for n in paged_nodes(convert(str(FIXTURES / "gemma2_eager_op18.onnx")))]
    assert gemma[0]["local_window_size"] == 4 and "local_window_size" not in gemma[1]  # sliding, full, ...
    for a in gemma:
        assert a["softcap"] == pytest.approx(50.0)
        assert a["scale"] == pytest.approx(32**-0.5, rel=1e-6)  # query_pre_attn_scalar=32, head_dim 16


def test_qk_norm_and_rope_move_into_the_op():
    converted = convert(str(FIXTURES / "qwen3_sdpa_op18.onnx"), rope_in_op=True, max_positions=64)
    node = paged_nodes(converted)[0]
    a = attrs(node)
    assert (a["do_rotary"], a["rotary_interleaved"]) == (1, 0)
    assert a["qk_norm_epsilon"] == pytest.approx(1e-6)
    inits = {i.name: i for i in converted.graph.initializer}
    casts = {n.output[0]: n for n in converted.graph.node if n.op_type == "Cast"}

    def stored(name: str) -> onnx.TensorProto:
        """The op's constant inputs are stored in float32 and cast to T in the graph (the twin reads them)."""
        cast = casts[name]
        assert attrs(cast)["to"] == onnx.TensorProto.FLOAT16
        return inits[cast.input[0]]

    assert list(stored(node.input[8]).dims) == [64, 16]  # cos cache [max_positions, head/2]
    assert list(stored(node.input[12]).dims) == [32] and list(stored(node.input[13]).dims) == [32]
    assert stored(node.input[12]).data_type == onnx.TensorProto.FLOAT
    assert not any(n.op_type in ("Cos", "Sin", "ReduceMean") and "self_attn" in n.name for n in converted.graph.node)
    assert "position_ids" not in {i.name for i in converted.graph.input}


def test_dropping_the_window_breaks_parity():
    """The harness can fail: without local_window_size the sliding layer attends to the whole context."""
    converted = convert(str(FIXTURES / "qwen2_sliding_sdpa_op18.onnx"))
    for node in paged_nodes(converted):
        kept = [a for a in node.attribute if a.name != "local_window_size"]
        del node.attribute[:]
        node.attribute.extend(kept)
    with pytest.raises(AssertionError):
        run_parity(converted, FIXTURES / "qwen2_sliding_sdpa_op18.onnx")


def test_near_miss_is_reported_and_left_alone():
    check_near_miss(
        near_miss("llama_sdpa_op18"),
        "1 of 2 layers are not MHA/GQA",
        match_attention_layers,
        AttentionLayer,
        LayerFailure,
    )


def test_mismatched_head_count_is_reported():
    """A value cache declared with 3 heads next to a 2-head key cache is not MHA/GQA: reported, not converted."""
    model = onnx.load(str(FIXTURES / "llama_sdpa_op18.onnx"))
    value = next(i for i in model.graph.input if i.name == "past_key_values.0.value")
    value.type.tensor_type.shape.dim[1].dim_value = 3
    with pytest.raises(ConversionError, match="1 of 2 layers") as info:
        convert(model)
    (where, why), *_ = info.value.failures
    assert where.startswith("layer 0") and "differs from key cache" in why


def test_mla_models_still_take_the_latent_path():
    converted = convert(str(FIXTURES / "dsv3_sdpa_op18.onnx"))
    assert {attrs(n)["kv_cache_layout"] for n in paged_nodes(converted)} == {b"LATENT"}


def test_float16_model():
    converted = convert(str(FIXTURES / "llama_sdpa_op18.onnx"), dtype="float16")
    # float32 stays only where integers are computed through floats (RoPE's positions times its frequencies)
    kept = [i for i in converted.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert all(len(i.raw_data or b"") <= 64 * 4 and "weight" not in i.name for i in kept), [i.name for i in kept]
    assert converted.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert validate_model(converted, backend="cuda").ok


@pytest.mark.export
def test_live_export_converts(tmp_path):
    """A fresh transformers export (not a stored fixture) converts and matches: guards against export drift.

    Needs the `export` extra, which CI installs: fails (never skips) without it."""
    from ortpa.export.hf import export_hf

    cfg = dict(TINY_LLAMA)
    path = tmp_path / "llama.onnx"
    export_hf(cfg, path, opset=18)
    result = run_parity(convert(str(path)), path)
    assert np.isfinite(result.max_abs_error)
