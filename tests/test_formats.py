"""The source side of parity: real-tool fixtures load in ONNX Runtime, their format is detected, and the
reference runner (:func:`ortpa.parity.greedy.dense_greedy` in each model's own format) is self-consistent.

The fixtures under ``tests/fixtures/formats/`` were made by the tools themselves (``scripts/make_fixtures_formats.py``):
onnxruntime-genai's builder, optimum, transformers' OnnxExporter and ortpa's dynamo export. Every expectation here
comes from how a file was made (its JSON: the tool, the Hugging Face config) or from an independent run, never
from the code under test.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from support.tolerances import assert_close, precision_logit_bound

from ortpa.errors import InvalidModel
from ortpa.formats.detect import SourceFormat, dense_interface, detect_format, length_thresholds
from ortpa.parity.check import default_prompts
from ortpa.parity.greedy import dense_forward, dense_greedy, open_dense

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FORMATS = FIXTURES / "formats"
NAMES = sorted(p.stem for p in FORMATS.glob("*.json") if not p.name.endswith(".genai_config.json"))
NEW_TOKENS = 6
SHORT = [5, 6, 7, 8, 9]


def _info(name: str) -> dict:
    return json.loads((FORMATS / f"{name}.json").read_text())


def _extra_atol(info: dict) -> float:
    # int4 builds quantize activations to int8 inside MatMulNBits (accuracy_level 4): a 1e-7 change of a row
    # (incremental vs one-shot attention) can flip one rounding; the precision rule's int8 logit bound allows it
    return precision_logit_bound("int8") if info["weights"].startswith("int4") else 0.0


def _long_prompt(info: dict) -> list[int]:
    """A prompt longer than every threshold the fixture has (LongRoPE's original length, a window)."""
    length = max([40, *(t + 8 for t in info["thresholds"].values())])
    return [4 + (7 * i) % (info["vocab_size"] - 4) for i in range(length)]


@pytest.fixture(scope="module")
def dense():
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = open_dense(FORMATS / f"{name}.onnx", threads=2)
        return cache[name]

    return get


def test_every_tool_has_fixtures() -> None:
    tools = {_info(n)["tool"] for n in NAMES}
    assert tools == {"genai", "optimum", "onnx_exporter", "ortpa"}, tools
    assert len(NAMES) >= 11


@pytest.mark.parametrize("name", NAMES)
def test_fixture_file_matches_its_json(name: str) -> None:
    """Small, self-contained, and its graph agrees with the config it was made from."""
    path = FORMATS / f"{name}.onnx"
    assert path.stat().st_size < 3 * 2**20
    assert not list(FORMATS.glob(f"{name}.onnx.data")), "external data must be folded into the fixture"
    info = _info(name)
    model = onnx.load(str(path), load_external_data=False)
    logits = next(o for o in model.graph.output if o.name == "logits")
    assert logits.type.tensor_type.shape.dim[-1].dim_value == info["vocab_size"]
    io = dense_interface(model)
    assert len(io.caches) == info["num_layers"]
    for c in io.caches:
        # genai leaves the head size a symbol ("kv_cache_dim"): found from the weights, it must be the config's
        assert (c.kv_heads, c.key_head_size, c.value_head_size) == (
            info["num_kv_heads"],
            info["head_size"],
            info.get("value_head_size", info["head_size"]),  # MLA: the latent, then the roped key part
        ), c
        assert c.dtype == np.dtype(info["dtype"])


@pytest.mark.parametrize("name", NAMES)
def test_detect_format(name: str) -> None:
    model = onnx.load(str(FORMATS / f"{name}.onnx"), load_external_data=False)
    assert detect_format(model) == SourceFormat(_info(name)["source_format"])


@pytest.mark.parametrize("name", ["llama_sdpa_op18", "qwen3_sdpa_op18", "dsv3_sdpa_op18"])
def test_detect_existing_dynamo_exports(name: str) -> None:
    model = onnx.load(str(FIXTURES / f"{name}.onnx"), load_external_data=False)
    assert detect_format(model) == SourceFormat.ORTPA_DYNAMO


@pytest.mark.parametrize("name", NAMES)
def test_inputs_follow_the_format(name: str, dense) -> None:
    """Which of attention_mask / position_ids the runner feeds is the model's own declaration."""
    io = dense(name).interface
    declared = {i.name for i in dense(name).session.get_inputs()}
    fmt = io.format
    assert (io.attention_mask is not None) == (fmt != SourceFormat.ONNX_EXPORTER) == ("attention_mask" in declared)
    assert (io.position_ids is not None) == ("position_ids" in declared)
    # optimum's Gemmas derive positions; ALiBi's come from the mask's CumSum (optimum drops position_ids)
    if fmt == SourceFormat.GENAI_GQA or name.startswith("optimum_gemma") or name == "optimum_falcon_alibi":
        assert io.position_ids is None
    else:
        assert io.position_ids is not None
    assert io.batch == (1 if fmt == SourceFormat.ONNX_EXPORTER else None)


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
@pytest.mark.parametrize("name", NAMES)
def test_reference_run_is_self_consistent(name: str, long: bool, dense) -> None:
    """Prefill then one-token decodes (past/present fed back) give the logits of one run over the whole sequence.

    The long prompt crosses every threshold of the fixture at prefill, so incremental and one-shot runs use the
    same RoPE factors throughout (crossing one mid-decode is checked by test_longrope_threshold_is_live).
    """
    info, model = _info(name), dense(name)
    prompt = _long_prompt(info) if long else SHORT
    run = dense_greedy(model.session, [prompt], NEW_TOKENS, interface=model.interface)
    assert run.runs == NEW_TOKENS and len(run.tokens[0]) == NEW_TOKENS
    full = dense_forward(model.session, prompt + run.tokens[0][:-1], interface=model.interface)
    assert full.shape == (len(prompt) + NEW_TOKENS - 1, info["vocab_size"])
    assert_close(
        run.logits[0],
        full[len(prompt) - 1 :],
        info["dtype"],
        what=f"{name}: incremental vs one-shot logits",
        extra_atol=_extra_atol(info),
    )
    assert run.tokens[0] == [int(r.argmax()) for r in run.logits[0]]


@pytest.mark.parametrize("name", [n for n in NAMES if "original_max_position_embeddings" in _info(n)["thresholds"]])
def test_longrope_threshold_is_live(name: str, dense) -> None:
    """The JSON's threshold is where the model switches factors: a decode step that takes the total length from
    T to T + 1 uses long factors for the new token only (its cached keys were roped short), so it differs from a
    one-shot run of T + 1 tokens; the step from T - 1 to T does not switch and matches."""
    info, model = _info(name), dense(name)
    t = info["thresholds"]["original_max_position_embeddings"]
    ids = [4 + (5 * i) % (info["vocab_size"] - 4) for i in range(t + 1)]

    def step_vs_full(total: int) -> float:
        run = dense_greedy(model.session, [ids[: total - 1]], 2, follow=[[ids[total - 1]]], interface=model.interface)
        full = dense_forward(model.session, ids[:total], interface=model.interface)
        return float(np.abs(run.logits[0][1] - full[-1]).max())

    assert step_vs_full(t) < 1e-4
    assert step_vs_full(t + 1) > 1e-2


@pytest.mark.parametrize("name", [n for n in NAMES if "new_tokens" in _info(n).get("genai_runtime_greedy", {})])
def test_genai_runtime_tokens(name: str, dense) -> None:
    """onnxruntime-genai's own greedy run of the fixture (recorded when it was built) gives the runner's tokens."""
    recorded, model = _info(name)["genai_runtime_greedy"], dense(name)
    run = dense_greedy(model.session, recorded["prompts"], len(recorded["new_tokens"][0]), interface=model.interface)
    assert run.tokens == recorded["new_tokens"]


def test_genai_fp16_builds_do_not_decode_in_genai_itself() -> None:
    """Why open_dense turns memory reuse off: onnxruntime-genai fails these files at the first decode step."""
    for name in ("genai_llama_fp16", "genai_qwen3_fp16"):
        assert "re-use buffer" in _info(name)["genai_runtime_greedy"]["error"], name


def test_sliding_window_layers_have_ring_caches() -> None:
    """Gemma-2 alternates sliding (layer 0) and full layers: only the sliding one has a fixed-size cache."""
    model = onnx.load(str(FORMATS / "genai_gemma2_fp32.onnx"), load_external_data=False)
    window = _info("genai_gemma2_fp32")["thresholds"]["sliding_window"]
    assert [c.capacity for c in dense_interface(model).caches] == [window, None]
    assert length_thresholds(model) == [window]


LLAMA_SAME_WEIGHTS = ["genai_llama_fp32", "genai_llama_fp16", "optimum_llama", "onnxexporter_llama"]
QWEN3_SAME_WEIGHTS = ["genai_qwen3_fp32", "genai_qwen3_fp16", "optimum_qwen3"]


@pytest.mark.parametrize("group", [LLAMA_SAME_WEIGHTS, QWEN3_SAME_WEIGHTS], ids=["llama", "qwen3"])
def test_formats_agree_on_the_same_weights(group: list[str], dense) -> None:
    """Each tool exported the same seeded weights: fed in its own format, each gives the same logits (within its
    dtype) — an independent check that masks, positions and caches are fed as each format expects."""
    prompts = [SHORT, _long_prompt(_info(group[0]))]
    ref_model = dense(group[0])
    ref = dense_greedy(ref_model.session, prompts, NEW_TOKENS, interface=ref_model.interface)
    for name in group[1:]:
        model = dense(name)
        got = dense_greedy(model.session, prompts, NEW_TOKENS, follow=ref.tokens, interface=model.interface)
        info = _info(name)
        # float16 weights and activations against float32: the precision rule's float16 logit bound
        extra = precision_logit_bound("float16") if info["weights"] == "float16" else 0.0
        for p in range(len(prompts)):
            assert_close(got.logits[p], ref.logits[p], info["dtype"], what=f"{name} vs {group[0]}", extra_atol=extra)
        assert got.tokens == ref.tokens, name


def test_llama_formats_agree_with_the_dynamo_export(dense) -> None:
    """tests/fixtures/llama_sdpa_op18 (ortpa export) was made from the same config and seed."""
    ours = open_dense(FIXTURES / "llama_sdpa_op18.onnx")
    genai = dense("genai_llama_fp32")
    a = dense_greedy(ours.session, [SHORT], NEW_TOKENS, interface=ours.interface)
    b = dense_greedy(genai.session, [SHORT], NEW_TOKENS, interface=genai.interface)
    assert a.tokens == b.tokens
    assert_close(b.logits[0], a.logits[0], "float32", what="genai fp32 vs dynamo")


@pytest.mark.parametrize("name", NAMES)
def test_length_thresholds_are_the_configs(name: str) -> None:
    """LongRoPE's switch is found in the graph (genai's If between two RoPE caches, dynamo's Where between two
    frequency tensors) at the config's original_max_position_embeddings; models without one have none."""
    model = onnx.load(str(FORMATS / f"{name}.onnx"), load_external_data=False)
    expected = dict(_info(name)["thresholds"])
    if _info(name)["tool"] in ("optimum", "onnx_exporter"):
        # their sliding window lives in the mask arithmetic: the recogniser finds it when converting
        # (tests/rewriter/test_optimum_families.py, test_onnx_exporter_sliding.py), length_thresholds does not
        # read it from the dense graph
        expected.pop("sliding_window", None)
    assert length_thresholds(model) == sorted(expected.values())


def test_gqa_window_is_a_threshold() -> None:
    model = onnx.load(str(FORMATS / "genai_llama_fp32.onnx"), load_external_data=False)
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            next(a for a in node.attribute if a.name == "local_window_size").i = 12
    assert length_thresholds(model) == [12]


def test_default_parity_prompts_pass_every_threshold() -> None:
    assert [len(p) for p in default_prompts([])] == [5, 2, 3]
    long = default_prompts([12, 32])[-1]
    assert len(long) > 32 and len(default_prompts([12, 32])) == 4


def test_paged_model_is_not_a_source() -> None:
    model = onnx.load(str(FIXTURES / "llama_sdpa_op18.onnx"), load_external_data=False)
    model.graph.node.add(op_type="PagedAttention", domain="com.microsoft", name="pa")
    with pytest.raises(InvalidModel, match="found a paged one"):
        detect_format(model)


def test_model_without_caches_is_refused() -> None:
    x = onnx.helper.make_tensor_value_info("input_ids", onnx.TensorProto.INT64, ["b", "s"])
    y = onnx.helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, ["b", "s", 8])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["input_ids"], ["logits"])], "g", [x], [y])
    with pytest.raises(InvalidModel, match="expected 4-D float KV cache inputs"):
        detect_format(onnx.helper.make_model(graph))


def test_symbolic_head_size_needs_the_graph(dense) -> None:
    """From a session alone a genai model's ``kv_cache_dim`` cannot be known: a clear error, not a wrong shape."""
    session = dense("genai_llama_fp32").session
    with pytest.raises(InvalidModel, match="kv_cache_dim"):
        dense_greedy(session, [SHORT], 1)


@pytest.mark.parametrize("name", ["genai_llama_fp16", "genai_qwen3_int4", "onnxexporter_llama"])
def test_cli_parity_drives_the_original_in_its_own_format(name: str, tmp_path, capsys) -> None:
    """``ortpa parity ORIGINAL CONVERTED`` on originals that the old driver could not feed (genai fp16: symbolic
    head size, memory-reuse defect; int4: no position_ids; OnnxExporter: no mask, its own cache names)."""
    from ortpa.cli import main
    from ortpa.rewriter.pipeline import convert

    converted = tmp_path / "paged.onnx"
    onnx.save(convert(str(FORMATS / f"{name}.onnx")), str(converted))
    # an int4 original: ortpa parity judges its precision as int8 (the activations' quantization) itself
    code = main(["parity", str(FORMATS / f"{name}.onnx"), str(converted), "--max-new-tokens", "4", "--json"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["ok"], result
    precision = result["precision"]
    assert precision["tokens_agree"] == precision["tokens_checked"] == 3 * 4  # no length threshold: 3 prompts


@pytest.mark.parametrize(("name", "depends"), [("ortpa_phi3_longrope", True), ("optimum_llama", False)])
def test_original_batch_dependence(name: str, depends: bool, dense) -> None:
    """The bug the converter must not copy: run batched (right-padded, masked), the dynamo LongRoPE original picks
    long factors for a short sequence because another one is long (ReduceMax over the whole batch's positions);
    a model without such a reduction gives the short sequence its logits alone."""
    model = dense(name)
    io, session = model.interface, model.session
    short, long = SHORT, _long_prompt(_info("ortpa_phi3_longrope"))
    alone = dense_forward(session, short, interface=io)[-1]
    width = len(long)
    ids = np.array([short + [0] * (width - len(short)), long], np.int64)
    mask = np.array([[1] * len(short) + [0] * (width - len(short)), [1] * width], np.int64)
    feed = {io.input_ids: ids, io.attention_mask: mask, io.position_ids: np.array([list(range(width))] * 2)}
    for c in io.caches:
        feed.update(c.empty(batch=2))
    batched = session.run([io.logits], feed)[0][0, len(short) - 1]
    diff = float(np.abs(batched - alone).max())
    assert (diff > 1e-2) if depends else (diff < 1e-4), diff
