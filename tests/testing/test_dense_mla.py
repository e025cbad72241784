"""The torch-free dense MLA builder: ONNX Runtime vs the NumPy forward, the matcher, and convert + paged parity.

The builder is checked on its own first (ORT's run of the graph against a float64 NumPy forward written from
the formulas), so the parity tests below compare the converter against a dense model known to be right.
Seeds are pinned to ones whose greedy choices are far from ties (top-2 gap well above the float16 error);
the parity helper asserts that precondition, so a changed weight init fails with a reason, not a flaky token.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import onnxscript.optimizer
import pytest
from support.tolerances import assert_close

from ortpa.errors import OrtpaError
from ortpa.parity.greedy import dense_greedy, paged_greedy
from ortpa.rewriter.layer import MlaLayer
from ortpa.rewriter.pipeline import convert
from ortpa.rewriter.recognisers.mla import match_mla_layers
from ortpa.runtime.session import PagedSession
from ortpa.testing.dense_mla import DenseMlaConfig, DenseMlaConfigError, build_dense_mla, dense_mla_weights
from ortpa.testing.dense_mla_reference import dense_mla_reference

# The export's shape (interleaved RoPE, q LoRA, ScatterND key) and the other branches of the builder.
EXPORT_LIKE = DenseMlaConfig(seed=2)
NEOX = DenseMlaConfig(rope_interleave=False, q_lora_rank=None, key_assembly="concat", mscale=1.2, seed=0)
CONFIGS = {"export_like": EXPORT_LIKE, "neox_noqlora_concat_mscale": NEOX}
PROMPT_LENGTHS, NEW_TOKENS = (5, 11, 3), 8  # prefill + 7 decode steps


def _session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def _feeds(cfg: DenseMlaConfig, rng: np.random.Generator, batch: int, seq: int, past: int, left_pad: int) -> dict:
    """Inputs with a past cache and the last row left-padded by ``left_pad`` masked positions."""
    mask = np.ones((batch, past + seq), np.int64)
    mask[-1, :left_pad] = 0
    feed = {
        "input_ids": rng.integers(0, cfg.vocab, (batch, seq)),
        "attention_mask": mask,
        "position_ids": np.maximum(np.cumsum(mask, axis=1)[:, past:] - 1, 0),
    }
    for i in range(cfg.layers):
        feed[f"past_key_values.{i}.key"] = rng.standard_normal((batch, 1, past, cfg.kv_lora_rank)).astype(np.float32)
        feed[f"past_key_values.{i}.value"] = rng.standard_normal((batch, 1, past, cfg.qk_rope)).astype(np.float32)
    return feed


def _reference(weights, cfg: DenseMlaConfig, feed: dict):
    past = [(feed[f"past_key_values.{i}.key"], feed[f"past_key_values.{i}.value"]) for i in range(cfg.layers)]
    return dense_mla_reference(weights, cfg, feed["input_ids"], feed["attention_mask"], feed["position_ids"], past)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize(("batch", "seq", "past", "left_pad"), [(2, 3, 4, 2), (3, 1, 6, 0), (1, 7, 0, 0)])
def test_builder_matches_numpy_reference(name, batch, seq, past, left_pad):
    cfg = CONFIGS[name]
    weights = dense_mla_weights(cfg)
    sess = _session(build_dense_mla(cfg, weights))
    feed = _feeds(cfg, np.random.default_rng(batch * 10 + seq), batch, seq, past, left_pad)
    logits, *present = sess.run(None, feed)
    ref_logits, ref_present = _reference(weights, cfg, feed)
    assert logits.shape == (batch, seq, cfg.vocab)
    assert_close(logits, ref_logits, np.float32, what="logits")
    for i, (key, value) in enumerate(ref_present):
        assert present[2 * i].shape == (batch, 1, past + seq, cfg.kv_lora_rank)
        assert_close(present[2 * i], key, np.float32, what=f"present.{i}.key")
        assert_close(present[2 * i + 1], value, np.float32, what=f"present.{i}.value")


def test_reference_comparison_can_fail():
    """A model whose softmax scale is 10% off (mscale 1.05) is caught by the same comparison."""
    weights = dense_mla_weights(EXPORT_LIKE)
    wrong = DenseMlaConfig(seed=2, mscale=1.05)
    sess = _session(build_dense_mla(wrong, weights))
    feed = _feeds(EXPORT_LIKE, np.random.default_rng(0), 2, 3, 4, 0)
    with pytest.raises(AssertionError):
        assert_close(sess.run(["logits"], feed)[0], _reference(weights, EXPORT_LIKE, feed)[0], np.float32)


def test_graph_has_the_export_structure():
    model = build_dense_mla(EXPORT_LIKE)
    ops = {n.op_type for n in model.graph.node}
    # torch's key assembly, torchlib's SDPA lowering and mask, HF's interleaved RoPE: what the matcher must see
    assert {"ScatterND", "ConstantOfShape", "GatherND", "IsNaN", "Softmax", "Split", "Cos", "Sin"} <= ops
    assert [i.name for i in model.graph.input][:3] == ["input_ids", "attention_mask", "position_ids"]
    outputs = ["logits"] + [f"present.{i}.{kv}" for i in range(EXPORT_LIKE.layers) for kv in ("key", "value")]
    assert [o.name for o in model.graph.output] == outputs
    assert any(v.name.startswith("/model/layers.0") for v in model.graph.value_info)  # shapes inferred, as exports
    with pytest.raises(DenseMlaConfigError, match="qk_rope must be even"):
        DenseMlaConfig(qk_rope=15)
    assert issubclass(DenseMlaConfigError, OrtpaError)


@pytest.mark.parametrize("optimized", [False, True], ids=["as_built", "optimized"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_matcher_finds_every_layer(name, optimized):
    cfg = DenseMlaConfig(**{**CONFIGS[name].__dict__, "layers": 3})
    model = ir.serde.deserialize_model(build_dense_mla(cfg))
    if optimized:  # what convert() matches on
        onnxscript.optimizer.optimize(model)
    results = match_mla_layers(model.graph)
    assert [r.layer for r in results] == [0, 1, 2]
    for m in results:
        assert isinstance(m, MlaLayer), m
        assert (m.num_heads, m.qk_nope, m.qk_rope, m.v_head, m.kv_lora_rank) == (
            cfg.heads,
            cfg.qk_nope,
            cfg.qk_rope,
            cfg.v_head,
            cfg.kv_lora_rank,
        )
        assert m.scale == pytest.approx(cfg.scale, rel=1e-6)
        assert m.rope_interleaved == int(cfg.rope_interleave)
        assert m.q_proj is not None and m.o_proj is not None and m.k_pe_raw is not None
        assert m.notes[0] == "matmul-softmax"


def _paged_vs_dense(converted: onnx.ModelProto, dense: onnx.ModelProto, vocab: int) -> float:
    """Greedy on the paged model (3 prompts batched) vs the dense one, every step; returns the worst error."""
    paged = PagedSession(converted, num_blocks=12, block_size=16, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    prompts = [[int(t) for t in rng.integers(0, vocab, n)] for n in PROMPT_LENGTHS]
    run = paged_greedy(paged, prompts, NEW_TOKENS)
    ref = dense_greedy(_session(dense), prompts, NEW_TOKENS, follow=run.tokens)
    worst = 0.0
    for p, (got, want) in enumerate(zip(run.logits, ref.logits, strict=True)):
        assert got.shape == want.shape == (NEW_TOKENS, vocab)
        for step in range(NEW_TOKENS):
            assert_close(got[step], want[step], np.float16, what=f"prompt {p} (length {len(prompts[p])}), step {step}")
        worst = max(worst, float(np.abs(got - want).max()))
        top2 = np.sort(want, axis=1)[:, -2:]
        assert (top2[:, 1] - top2[:, 0]).min() > 5 * worst, "precondition: greedy choices must not be near ties"
    assert run.tokens == ref.tokens, "greedy tokens differ"
    return worst


@pytest.mark.parametrize(
    ("name", "options"),
    [("export_like", {}), ("export_like", {"rope_in_op": True}), ("neox_noqlora_concat_mscale", {"absorb": "matmul"})],
)
def test_convert_parity_through_paged_session(name, options):
    cfg = CONFIGS[name]
    dense = build_dense_mla(cfg)
    converted = convert(dense, **options)
    assert sum(n.op_type == "PagedAttention" for n in converted.graph.node) == cfg.layers
    worst = _paged_vs_dense(converted, dense, cfg.vocab)
    assert worst < 5e-3


def test_parity_check_catches_a_wrong_scale():
    dense = build_dense_mla(EXPORT_LIKE)
    converted = convert(dense)
    for node in converted.graph.node:
        for attr in node.attribute:
            if node.op_type == "PagedAttention" and attr.name == "scale":
                attr.f *= 1.1
    with pytest.raises(AssertionError):
        _paged_vs_dense(converted, dense, EXPORT_LIKE.vocab)
