"""onnxruntime-genai 0.18's builder takes any Linear with ``vocab_size`` outputs for the LM head; with Phi-3's
fused ``gate_up_proj`` (``2 * intermediate_size == vocab_size``) the logits read layer 0's post-attention norm and
layer 1 only appends to its caches (``genai_phi3_deadlayer_fp16``, made by ``scripts/make_fixtures_formats.py
genai``: hidden 64, 4 heads / 2 KV heads, head 16, two layers, fp16). At fp16 layer 1's MultiHeadAttention reaches
no output; the optimizer dropped it and ortpa refused the layer ("key cache heads / head size are not static",
the sweep's genai phi3 seed 0). The export computes a definite function, and its greedy tokens are what a
conversion must give (:mod:`ortpa.rewriter.dead_attention`)."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir
from support.parity import run_parity

from ortpa.conversion import convert_file
from ortpa.rewriter import dead_attention
from ortpa.rewriter.recognisers import recognise_separate_layers
from ortpa.rewriter.recognisers.caches import canonicalise_cache_io

FORMATS = Path(__file__).resolve().parents[1] / "fixtures" / "formats"
FIXTURE = FORMATS / "genai_phi3_deadlayer_fp16.onnx"


def test_the_fixture_has_the_builders_lm_head_defect():
    graph = onnx.load(str(FIXTURE), load_external_data=False).graph
    (lm_head,) = [n for n in graph.node if n.name == "/lm_head/MatMul"]
    assert lm_head.input[0] == "/model/layers.0/post_attention_layernorm/output_0"
    key = next(i for i in graph.input if i.name == "past_key_values.1.key")
    assert key.type.tensor_type.shape.dim[3].dim_param == "kv_cache_dim"


def test_only_the_dead_attention_is_pinned_and_every_layer_is_recognised():
    model = ir.load(str(FIXTURE))
    canonicalise_cache_io(model.graph)
    pinned = dead_attention.pin(model.graph)
    assert [v.producer().name for v in pinned] == ["/model/layers.1/attn/MultiHeadAttention"]
    from onnxscript import optimizer

    optimizer.optimize(model)
    layers = recognise_separate_layers(model.graph)
    assert [getattr(m, "source", None) for m in layers] == ["MultiHeadAttention"] * 2, layers
    assert all((m.num_heads, m.kv_num_heads, m.head_size) == (4, 2, 16) for m in layers)
    dead_attention.unpin(model.graph, pinned)
    assert [v.name for v in model.graph.outputs if v.name.startswith("/model")] == []
    # a model whose attention is live pins nothing (genai's Llama fp16 build: the same form, no defect)
    llama = ir.load(str(FORMATS / "genai_llama_fp16.onnx"))
    assert dead_attention.pin(llama.graph) == []


def test_the_export_converts_verified_and_batched_equals_alone(tmp_path):
    out = tmp_path / "paged.onnx"
    verification = convert_file(FIXTURE, out).verification  # verification on (the default)
    assert verification is not None and verification.ok
    paged = onnx.load(str(out))
    assert sum(n.op_type == "PagedAttention" for n in paged.graph.node) == 2  # layer 1 still writes its cache
    assert {p.key: p.value for p in paged.metadata_props}["ortpa.unread_attention_layers"] == "1"
    assert not {n.op_type for n in paged.graph.node} & {"MultiHeadAttention", "Softmax"}
    result = run_parity(paged, FIXTURE, steps=8)
    assert result.tokens_checked == 24 and result.max_context >= 18
    assert result.near_ties <= 2
