"""onnxruntime-genai's fp16 Phi build (``genai_phi_fp16``: partial rotary 0.5, 4 heads / 4 KV heads, head 16,
made by ``scripts/make_fixtures_formats.py genai``) hands each layer's caches to ``com.microsoft::MultiHeadAttention``
as its own ``past_key`` / ``past_value`` (the op appends the new keys / values and emits ``present.{i}.*``); the
Llama fp16 build concatenates before the op instead. ortpa refused every layer of this form (the sweep's genai phi
seed 1, docs/sweep.md)."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
from support.parity import run_parity

from ortpa.conversion import convert_file
from ortpa.errors import ConversionError
from ortpa.formats.shapes import cache_head_size, ir_graph
from ortpa.rewriter.pipeline import convert
from ortpa.rewriter.recognisers import recognise_separate_layers
from ortpa.rewriter.recognisers.caches import canonicalise_cache_io

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "formats" / "genai_phi_fp16.onnx"


def test_the_ops_own_past_is_recognised_with_the_new_keys_and_values():
    model = ir.load(str(FIXTURE))
    canonicalise_cache_io(model.graph)
    layers = recognise_separate_layers(model.graph)
    assert [getattr(m, "source", None) for m in layers] == ["MultiHeadAttention"] * 2, layers
    # the fixture's config: hidden 64, 4 heads, 4 KV heads (MHA's past is one KV head per query head)
    assert all((m.num_heads, m.kv_num_heads, m.head_size) == (4, 4, 16) for m in layers)
    mha = [n for n in model.graph if n.op_type == "MultiHeadAttention"]
    assert [(m.key, m.value) for m in layers] == [(n.inputs[1], n.inputs[2]) for n in mha]
    assert all(m.scale == pytest.approx(0.25) for m in layers)  # the op's scale attribute


def test_the_cache_head_size_follows_from_the_ops_new_key():
    graph = ir_graph(onnx.load(str(FIXTURE), load_external_data=False))
    assert [cache_head_size(graph, f"past_key_values.{i}.{kind}") for i in (0, 1) for kind in ("key", "value")] == [
        16
    ] * 4


def test_past_key_from_another_layer_is_refused_by_layer():
    model = onnx.load(str(FIXTURE))
    node = [n for n in model.graph.node if n.op_type == "MultiHeadAttention"][1]
    node.input[7] = "past_key_values.0.value"
    with pytest.raises(ConversionError) as info:
        convert(model, providers=())
    (where, why), *rest = info.value.failures
    assert not rest and where.startswith("layer 1") and "past_value" in why, info.value.failures


def test_genai_phi_fp16_converts_verified_and_batched_equals_alone(tmp_path):
    out = tmp_path / "paged.onnx"
    verification = convert_file(FIXTURE, out).verification  # verification on (the default)
    assert verification is not None and verification.ok
    paged = onnx.load(str(out))
    assert not {n.op_type for n in paged.graph.node} & {"MultiHeadAttention", "Softmax"}
    # 3 sequences of different lengths prefilled together, then packed decode steps: each row = the dense op alone
    result = run_parity(paged, FIXTURE, steps=8)
    assert result.tokens_checked == 24 and result.max_context >= 18
    assert result.near_ties <= 2
