"""Recogniser: com.microsoft::GroupQueryAttention (the onnxruntime-genai builder's fp32 / int4 form).

Each toy varies one feature of the op; the converted model is driven with continuous batching on the portable
op and compared with the original run alone by ONNX Runtime's own GroupQueryAttention kernel (CPU): that is
what pins down the meaning of every attribute carried over (RoPE tables, interleaving, window, softcap, scale).
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest
from genai_toy import GqaToy, gqa_toy_model
from support.parity import attrs, paged_nodes, run_parity

from ortpa.errors import ConversionError
from ortpa.rewriter.layer import AttentionLayer
from ortpa.rewriter.pipeline import convert
from ortpa.rewriter.recognisers import recognise_separate_layers

CASES = {
    "packed_rotary": GqaToy(),
    "separate_qkv": GqaToy(packed=False),
    "qk_norm": GqaToy(packed=False, qk_norm=True),
    "interleaved": GqaToy(interleaved=1),
    "window": GqaToy(window=6),  # parity prompts reach ~20 tokens: the window is crossed
    "softcap_scale": GqaToy(softcap=3.0, scale=0.4),
    "no_rotary": GqaToy(do_rotary=0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gqa_converts_with_parity(case, tmp_path):
    cfg = CASES[case]
    path = tmp_path / "gqa.onnx"
    onnx.save(gqa_toy_model(cfg), path)
    paged = convert(path)
    nodes = paged_nodes(paged)
    assert len(nodes) == cfg.layers
    a = attrs(nodes[0])
    assert (a["num_heads"], a["kv_num_heads"]) == (cfg.heads, cfg.kv_heads)
    assert a.get("do_rotary", 0) == cfg.do_rotary and a.get("rotary_interleaved", 0) == cfg.interleaved
    assert not any(n.op_type == "GroupQueryAttention" for n in paged.graph.node)
    assert {i.name for i in paged.graph.input}.isdisjoint({"attention_mask"})
    result = run_parity(paged, path, steps=8)
    assert result.tokens_checked >= 24 and result.max_context > max(cfg.window, 16)
    # at least three quarters of the steps compare tokens where no tie is possible (ortpa.tolerances' margin;
    # measured 1-4 of 24 over these toys)
    flat = f"{result.near_ties} near-tie greedy steps: the toy's logits are too flat to compare tokens"
    assert result.near_ties <= result.tokens_checked // 4, flat


def test_gqa_description():
    model = ir.serde.deserialize_model(gqa_toy_model(GqaToy(window=6, softcap=3.0)))
    (m0, m1) = recognise_separate_layers(model.graph)
    assert isinstance(m0, AttentionLayer) and isinstance(m1, AttentionLayer)
    assert (m0.num_heads, m0.kv_num_heads, m0.head_size, m0.packed_qkv, m0.layout) == (4, 2, 16, True, "bsd")
    assert m0.local_window_size == 6 and m0.softcap == 3.0 and m0.rotary is not None
    assert m0.source == "GroupQueryAttention"


def _mutated(mutate) -> onnx.ModelProto:
    model = gqa_toy_model()
    node = next(n for n in model.graph.node if n.op_type == "GroupQueryAttention" and "layers.1" in n.name)
    mutate(node)
    return model


NEAR_MISSES = {
    # smooth_softmax converts (zero head_sink: tests/rewriter/test_genai_gptoss.py); qk_output has no paged form
    "qk_output": (lambda n: n.attribute.append(onnx.helper.make_attribute("qk_output", 1)), "qk_output"),
    "attention_bias": (
        lambda n: n.input.extend(["", "seqlens_k"]) if len(n.input) == 9 else None,
        "attention_bias is set",
    ),
}


@pytest.mark.parametrize("case", sorted(NEAR_MISSES))
def test_gqa_near_miss_reported_by_layer(case):
    mutate, reason = NEAR_MISSES[case]
    with pytest.raises(ConversionError) as info:
        convert(_mutated(mutate), providers=())
    (where, why), *rest = info.value.failures
    assert not rest and where.startswith("layer 1") and reason in why


def test_logits_written_by_lm_head(tmp_path):
    """lm_head's MatMul produces the ``logits`` output itself (hidden-wide rows squeezed before it): a Squeeze after
    it would copy every vocabulary-wide row once more per step."""
    path = tmp_path / "gqa.onnx"
    onnx.save(gqa_toy_model(GqaToy()), path)
    paged = convert(path)
    (producer,) = [n for n in paged.graph.node if "logits" in n.output]
    assert producer.op_type == "MatMul"
    weight = {i.name for i in paged.graph.initializer}
    assert producer.input[1] in weight  # lm_head's own weight
    (squeeze,) = [n for n in paged.graph.node if producer.input[0] in n.output]
    assert squeeze.op_type == "Squeeze"
