"""The seeded config sweep (:mod:`ortpa.testing.sweep`): its draws cover the space the issue names, its judge
catches a wrong conversion, its refusals are sorted by what they name, and a few seeds per family convert
correctly (the whole sweep: ``python -m ortpa.testing.sweep``, table in ``docs/sweep.md``)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
from support.parity import FIXTURES

from ortpa.errors import ConversionError, UnsupportedModel
from ortpa.testing.export_tools import host_built, legacy_config
from ortpa.testing.sweep import FAMILIES, OUTCOMES, classify_refusal, draw, run_draw, sweep_prompts
from ortpa.testing.sweep.report import tool_tables
from ortpa.testing.sweep.run import CORRECT, ERROR, LEAK, OTHER, UNSUPPORTED, WRONG, Outcome, convert_and_judge
from ortpa.testing.sweep.space import GENAI_PRECISIONS, TOOL_FAMILIES

SEEDS = range(12)
MOE = ("deepseek_v2", "deepseek_v3")
ALTERNATING = ("gemma2", "gemma3")


def test_a_seed_draws_the_same_config_every_time():
    for family in FAMILIES:
        assert draw(family, 3) == draw(family, 3)
        assert draw(family, 3).config != draw(family, 4).config, family


def test_the_draws_cover_the_space():
    """Across a dozen seeds: depth 2-6, widths 64-1024, head dims 32-128, ratios 1-8, vocab 256-32k, every
    checkpoint dtype (FP8 for DeepSeek-V3), MoE in consecutive layers, alternating windows over >= 3 layers."""
    draws = [draw(f, s) for f in FAMILIES for s in SEEDS]
    cfgs = [d.config for d in draws]
    assert {c["num_hidden_layers"] for c in cfgs} == {2, 3, 4, 5, 6}
    assert {c["hidden_size"] for c in cfgs} == {64, 128, 256, 512, 1024}
    dense = [c for c in cfgs if "head_dim" in c and c["model_type"] != "phi3"]
    assert {c["head_dim"] for c in dense} == {32, 64, 128}
    assert {c["num_attention_heads"] // c["num_key_value_heads"] for c in dense} == {1, 2, 4, 8}
    assert min(c["vocab_size"] for c in cfgs) == 256 and max(c["vocab_size"] for c in cfgs) == 32000
    assert {d.source_dtype for d in draws} == {"float32", "float16", "bfloat16", "fp8"}
    assert {d.family for d in draws if d.source_dtype == "fp8"} == {"deepseek_v3"}
    ropes = {n for d in draws for n in d.notes if n.startswith("rope:")}
    assert ropes >= {"rope:linear", "rope:dynamic", "rope:yarn", "rope:llama3", "rope:longrope"}
    for d in draws:
        c = d.config
        if d.family in MOE:  # MoE in every layer past the first: at least two consecutive MoE layers
            assert c["first_k_dense_replace"] == 1 and c["num_hidden_layers"] >= 3, d
        if d.family in ALTERNATING or d.family in MOE:
            assert c["num_hidden_layers"] >= 3, d
        if d.family == "mistral":
            assert c["num_key_value_heads"] == 1 and c["sliding_window"] > 0
        embed = c["vocab_size"] * c["hidden_size"]
        assert embed <= 1 << 21, d  # small enough to export in seconds


def test_the_moe_draws_cover_what_deepseek_checkpoints_ship():
    """Within a dozen seeds the MoE families draw what the DeepSeek checkpoints ship: three or more MoE layers
    (every layer past the first) from float32, float16, bfloat16 and FP8 folders, group-limited routing over three
    or more MoE layers, shared experts, a routed scaling factor, and V2's both top-k methods."""
    draws = [draw(f, s) for f in MOE for s in SEEDS]
    deep = [d for d in draws if d.config["num_hidden_layers"] - d.config["first_k_dense_replace"] >= 3]
    assert {d.source_dtype for d in deep} == {"float32", "float16", "bfloat16", "fp8"}, [d.summary() for d in deep]
    assert any((d.config.get("n_group") or 1) > 1 and d.config.get("topk_group", 1) < d.config["n_group"] for d in deep)
    assert {d.source_dtype for d in draws} == {"float32", "float16", "bfloat16", "fp8"}
    assert all(d.config["n_shared_experts"] >= 1 for d in draws)
    assert {d.config["routed_scaling_factor"] for d in draws} >= {1.0, 2.5}
    assert {d.config["topk_method"] for d in draws if d.family == "deepseek_v2"} == {"greedy", "group_limited_greedy"}


def test_the_tool_axis_draws_the_same_model_and_every_genai_precision():
    """A seed is the same model under every tool; genai draws each builder precision within three seeds of a
    family; FP8 checkpoints stay with ortpa's own export (the other tools read bfloat16 instead)."""
    for tool, families in TOOL_FAMILIES.items():
        for family in families:
            assert draw(family, 1, tool).config == draw(family, 1).config, (tool, family)
    for family in TOOL_FAMILIES["genai"]:
        assert {draw(family, s, "genai").tool_options["precision"] for s in range(3)} == set(GENAI_PRECISIONS)
    fp8 = next(s for s in SEEDS if draw("deepseek_v3", s).source_dtype == "fp8")
    assert draw("deepseek_v3", fp8, "optimum").source_dtype == "bfloat16"
    assert {"falcon", "stablelm", "gpt_neox", "phi"} <= set(TOOL_FAMILIES["optimum"])
    assert not {"falcon", "stablelm", "gpt_neox", "phi"} & set(TOOL_FAMILIES["dynamo"])


def test_configs_reach_transformers_4_in_its_own_spelling():
    """optimum's transformers 4.57 ignores ``rope_parameters``: the scaling and both Gemma-3 bases must move."""
    llama = legacy_config(draw("llama", 1).config)  # linear scaling
    assert "rope_parameters" not in llama and llama["rope_theta"] in (10000.0, 500000.0)
    factor = draw("llama", 1).config["rope_parameters"]["factor"]
    assert llama["rope_scaling"] == {"rope_type": "linear", "type": "linear", "factor": factor}
    phi3 = legacy_config(draw("phi3", 1).config)  # LongRoPE: 4.x's Phi-3 wants exactly these three fields
    assert set(phi3["rope_scaling"]) == {"type", "short_factor", "long_factor"}
    plain = legacy_config(draw("llama", 0).config)
    assert "rope_scaling" not in plain
    gemma3 = draw("gemma3", 1).config
    legacy = legacy_config(gemma3)
    rope = gemma3["rope_parameters"]
    assert legacy["rope_theta"] == rope["full_attention"]["rope_theta"]
    assert legacy["rope_local_base_freq"] == rope["sliding_attention"]["rope_theta"]
    assert legacy["rope_scaling"]["type"] == rope["full_attention"]["rope_type"] != "default"
    # a config transformers 5 saved keeps the partial rotary factor inside rope_parameters; 4.x reads the top
    saved = {
        "model_type": "stablelm",
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    }
    assert legacy_config(saved) == {"model_type": "stablelm", "rope_theta": 1e4, "partial_rotary_factor": 0.5}


def test_configs_the_tools_transformers_cannot_build_are_built_by_ortpas():
    """transformers 4.57 cannot initialize StableLM's bias-less per-head q/k LayerNorms: such a draw's folder is
    saved with transformers 5 (then written in 4.x's spelling); every other optimum draw by the tool's own."""
    stablelm = [draw("stablelm", s, "optimum").config for s in SEEDS]
    assert any(c["qk_layernorm"] for c in stablelm) and not all(c["qk_layernorm"] for c in stablelm)
    for c in stablelm:
        assert bool(host_built("optimum", c)) == c["qk_layernorm"]
    assert not any(
        host_built("optimum", draw(f, 0, "optimum").config) for f in TOOL_FAMILIES["optimum"] if f != "stablelm"
    )


def test_falcon_draws_each_attention_layout():
    """multi-query (falcon-7b), classic MHA and ALiBi (falcon-rw), the new decoder architecture (falcon-40b) within
    four seeds; parallel attention and bias both ways within a dozen."""
    cfgs = [draw("falcon", s, "optimum").config for s in SEEDS]
    kinds = {(c["multi_query"], c["new_decoder_architecture"], c["alibi"]) for c in cfgs[:4]}
    assert kinds == {(True, False, False), (False, False, False), (False, False, True), (False, True, False)}
    for c in cfgs:
        heads, kv = c["num_attention_heads"], c["num_kv_heads"]
        assert kv == (1 if c["multi_query"] else kv if c["new_decoder_architecture"] else heads) and heads % kv == 0
    assert {c["parallel_attn"] for c in cfgs} == {c["bias"] for c in cfgs} == {True, False}


def test_genai_folders_are_written_in_the_legacy_spelling(tmp_path):
    """The genai builder reads Phi-3's LongRoPE as ``rope_scaling["type"]`` (``KeyError: 'type'`` on transformers
    5's ``rope_parameters``, the sweep's genai phi3 seed 1); the folder must still be the same model to
    transformers 5."""
    import json

    from transformers import AutoConfig

    from ortpa.testing.export_tools import write_legacy_config

    cfg = dict(draw("phi3", 1).config)
    AutoConfig.for_model(cfg.pop("model_type"), **cfg).save_pretrained(tmp_path)  # as build_hf_dir saves it
    write_legacy_config(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" not in saved and saved["rope_scaling"]["type"] == "longrope"
    rope = AutoConfig.from_pretrained(tmp_path).rope_parameters
    assert rope["rope_type"] == "longrope" and rope["long_factor"] == cfg["rope_parameters"]["long_factor"]
    assert rope["short_factor"] == cfg["rope_parameters"]["short_factor"]


def test_prompts_pass_every_threshold():
    prompts = sweep_prompts(1000, [4, 32], seed=0)
    assert len({len(p) for p in prompts}) == len(prompts) and max(len(p) for p in prompts) > 32
    assert all(0 <= t < 1000 for p in prompts for t in p)


def test_refusals_are_sorted_by_what_they_name():
    flow = "values computed over the whole packed step (every sequence's tokens) cannot be made per sequence"
    leak = ConversionError(flow, [("node '/m/ReduceMax'", "reduces across the tokens of every sequence in the step")])
    gap = ConversionError(
        flow, [("PagedAttention node 'x'", "the flow cannot follow the token axis here; rows (unknown is step-wide)")]
    )
    regrouped = ConversionError(flow, [("node 'y'", "its rows are regrouped across the step's tokens")])
    mismatch = ConversionError("the converted model does not match the original", [("layer 1", "max |dlogit| 0.02")])
    assert classify_refusal(leak)[0] == LEAK
    assert classify_refusal(gap)[0] == OTHER
    assert classify_refusal(regrouped)[0] == OTHER
    assert classify_refusal(mismatch)[0] == OTHER
    outcome, reason = classify_refusal(ValueError("boom\nmore"))
    assert outcome == ERROR and reason == "ValueError: boom"
    assert "ReduceMax" in classify_refusal(leak)[1]  # the reason names where
    # refused up front: a named leak when the model mixes sequences (dynamic NTK), else unsupported (ALiBi)
    assert classify_refusal(UnsupportedModel("m", "dynamic NTK", mixes_sequences=True))[0] == LEAK
    assert classify_refusal(UnsupportedModel("layer 0", "ALiBi"))[0] == UNSUPPORTED


def test_tables_count_refused_unsupported_only_where_drawn():
    """The sixth outcome gets a column where a draw has it; tables without one keep the five columns."""

    def outcome(seed: int, kind: str) -> Outcome:
        return Outcome("falcon", seed, "L2", kind, "", 1.0, "done", tool="optimum")

    plain = tool_tables([outcome(0, CORRECT)]).splitlines()
    assert UNSUPPORTED not in plain[2] and plain[4] == "| optimum | falcon | 1 | 0 | 0 | 0 | 0 |"
    drawn = tool_tables([outcome(0, CORRECT), outcome(2, UNSUPPORTED)]).splitlines()
    assert drawn[2].endswith(f"| {UNSUPPORTED} |") and drawn[4] == "| optimum | falcon | 1 | 0 | 0 | 0 | 0 | 1 |"


def _paged(dense: str, out: str, scale_factor: float | None) -> None:
    """``dense`` converted unverified into ``out``, every PagedAttention scale times ``scale_factor``."""
    from ortpa.rewriter.pipeline import convert

    model = convert(dense)
    head_dim = json.loads((FIXTURES / "llama_sdpa_op18.json").read_text())["config"]["head_dim"]
    if scale_factor is not None:
        nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
        assert nodes
        for node in nodes:  # the op's default scale is 1/sqrt(head size); state it, times the factor
            kept = [a for a in node.attribute if a.name != "scale"]
            del node.attribute[:]
            node.attribute.extend([*kept, onnx.helper.make_attribute("scale", scale_factor / head_dim**0.5)])
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, out)


def test_the_sweep_records_a_wrong_conversion_as_wrong(tmp_path):
    """The classifier can fail: a convert that writes the model with its softmax scale tripled is `wrong`, the
    true conversion is correct, and a refusal of a correct model is `refused-other` with a second opinion
    saying its unverified tokens were the original's."""
    dense = FIXTURES / "llama_sdpa_op18.onnx"
    prompts = sweep_prompts(256, [], seed=1)

    def tampered(src, out, **_):
        _paged(src, out, 3.0)

    def true(src, out, **_):
        _paged(src, out, None)

    def refusing(src, out, verify=True, **_):
        if verify:
            raise ConversionError("the converted model does not match the original", [("layer 0", "max |d| 0.1")])
        _paged(src, out, None)

    outcome, reason, err_bad = convert_and_judge(dense, tmp_path / "a.onnx", prompts, steps=4, convert=tampered)
    assert outcome == WRONG and "outside the tie rule" in reason
    outcome, reason, err = convert_and_judge(dense, tmp_path / "b.onnx", prompts, steps=4, convert=true)
    assert outcome == CORRECT and not reason and err_bad > 10 * err
    outcome, reason, _ = convert_and_judge(dense, tmp_path / "c.onnx", prompts, steps=4, convert=refusing)
    assert outcome == OTHER and "unverified: written, greedy tokens the original's" in reason


def test_an_int8_activation_original_is_judged_with_float32_activations_too(tmp_path):
    """A genai int4 build (MatMulNBits accuracy_level=4): its float32-activation copy is what the sweep holds to the
    converted dtype's full tie rule, where int8's step cannot excuse a flip. The true conversion passes with a
    float16-sized error there; one with its softmax scale x1.5 is wrong, and that copy's comparison says so."""
    import shutil

    from ortpa.rewriter.pipeline import convert
    from ortpa.testing.sweep.judge import float32_activations, judge_conversion

    name = "genai_qwen3_int4"
    dense = tmp_path / f"{name}.onnx"
    shutil.copy(FIXTURES / "formats" / f"{name}.onnx", dense)
    head_size = json.loads((FIXTURES / "formats" / f"{name}.json").read_text())["head_size"]
    with float32_activations(dense) as copy:
        levels = {a.i for n in onnx.load(str(copy)).graph.node for a in n.attribute if a.name == "accuracy_level"}
        assert levels == {0}
    assert not copy.exists()  # removed on exit
    prompts = sweep_prompts(256, [], seed=1)
    true, tampered = tmp_path / "true.onnx", tmp_path / "tampered.onnx"
    model = convert(dense)  # unverified: the sweep's judge is under test
    onnx.save(model, true)
    for node in (n for n in model.graph.node if n.op_type == "PagedAttention"):
        kept = [a for a in node.attribute if a.name != "scale"]
        del node.attribute[:]
        node.attribute.extend([*kept, onnx.helper.make_attribute("scale", 1.5 / head_size**0.5)])
    onnx.save(model, tampered)

    good = judge_conversion(dense, true, prompts, steps=4)
    assert good.correct, good.reason
    assert good.float32_activations_error is not None and good.float32_activations_error < 0.02
    bad = judge_conversion(dense, tampered, prompts, steps=4)
    assert not bad.correct and "float32 activations, batched vs original" in bad.reason, bad.reason


def _smallest_seed(family: str, seeds: range = range(8)) -> int:
    """The seed among ``seeds`` whose draw has the fewest weights (export time grows with depth and width)."""

    def size(c: dict) -> int:
        width = c["hidden_size"] * (c["hidden_size"] + c.get("intermediate_size", 0))
        return c["num_hidden_layers"] * width + c["vocab_size"] * c["hidden_size"]

    return min(seeds, key=lambda s: size(draw(family, s).config))


# In CI the smallest of the first eight draws of three families (GQA with a window, alternating windows and
# softcaps, MoE in consecutive layers): one export each. The rest: seed 0 of every family, with ORTPA_SLOW=1.
CI = [(f, _smallest_seed(f)) for f in ("mistral", "gemma2", "deepseek_v3")]
SLOW = [(f, 0) for f in TOOL_FAMILIES["dynamo"]]


def _check(family: str, seed: int, tmp_path) -> None:
    outcome = run_draw(draw(family, seed), tmp_path)
    assert outcome.outcome in OUTCOMES
    assert outcome.outcome in (CORRECT, LEAK), (
        f"{outcome.config}: {outcome.outcome} at {outcome.stage}: {outcome.reason}"
    )


@pytest.mark.export
@pytest.mark.parametrize(("family", "seed"), CI)
def test_sweep_seed(family, seed, tmp_path):
    _check(family, seed, tmp_path)


@pytest.mark.export
@pytest.mark.slow
@pytest.mark.parametrize(("family", "seed"), SLOW)
def test_sweep_seed_slow(family, seed, tmp_path):
    _check(family, seed, tmp_path)


def test_dynamic_rope_is_a_named_refusal_not_an_export_error():
    """llama seed 2 draws dynamic NTK RoPE, whose frequencies follow the batch's longest position: refused up front
    (ortpa.export.rope_support), recorded as a named leak with the reason."""
    d = draw("llama", 2)
    assert d.config["rope_parameters"]["rope_type"] == "dynamic"
    outcome = run_draw(d)
    assert (outcome.outcome, outcome.stage) == (LEAK, "export"), outcome
    assert "RoPE scaling 'dynamic'" in outcome.reason
