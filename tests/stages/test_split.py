"""`ortpa split`: a paged model cut into pipeline stages, each with its own weights, run in one process.

The reference is always the unsplit model driven by the same Engine (exact token equality), batched with
prompts of different lengths against each run alone; the stages' files are read back to check that each holds
only its own weights. Running the stages as Ray actors: tests/runtime/test_pipeline_ray.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortpa.conversion import ConvertOptions, convert_file
from ortpa.errors import InvalidModel, SplitRefused
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.runtime.stage_chain import StageChain
from ortpa.runtime.stage_folder import MANIFEST, read_stage_folder
from ortpa.stages import split_model
from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CPU = ["CPUExecutionProvider"]
BS = 4
LENGTHS = [(3, 9), (17, 5), (40, 12), (1, 7), (26, 4)]


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, size=n)] for n, _ in LENGTHS]


PARAMS = [SamplingParams(max_new_tokens=m) for _, m in LENGTHS]


def _engine(model, **kw) -> Engine:
    kw.setdefault("num_blocks", 96)
    if Path(model).is_dir():
        kw.setdefault("stages", "local")
    return Engine(model, block_size=BS, providers=CPU, **kw)


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> Path:
    """A Llama-style GQA toy (RoPE in the op, a learned position embedding) with 4 layers, as a file."""
    path = tmp_path_factory.mktemp("toy") / "toy.onnx"
    onnx.save(build_toy_lm(ToyLMConfig(num_layers=4, position_ids=True, seed=2)), path)
    return path


@pytest.fixture(scope="module")
def mla_moe(tmp_path_factory) -> Path:
    """DeepSeek-V3 (MLA, one dense layer then two MoE layers) converted by `convert` (verified there)."""
    out = tmp_path_factory.mktemp("mla") / "paged.onnx"
    convert_file(FIXTURES / "dsv3_moe3_sdpa_op18.onnx", out, ConvertOptions.of(verify=False))
    return out


def _alone(model: Path, vocab: int) -> list[list[int]]:
    engine = _engine(model, enable_prefix_caching=False)
    return [engine.generate([p], s)[0] for p, s in zip(_prompts(vocab), PARAMS, strict=True)]


@pytest.mark.parametrize("stages", [2, 3])
def test_toy_stages_give_the_unsplit_tokens_batched_and_alone(toy, tmp_path, stages):
    result = split_model(toy, tmp_path / "s", stages)
    assert result.proof is not None and result.proof.tokens > 0
    reference = _alone(toy, 64)
    folder = tmp_path / "s"
    # batched, with chunked prefill (a budget of 8 tokens a step mixes prompt chunks with decodes)
    chunked = _engine(folder, max_num_batched_tokens=8).generate(_prompts(64), PARAMS)
    assert chunked == reference
    # batched with prefix caching: a second round adopts the first round's blocks
    engine = _engine(folder)
    assert engine.generate(_prompts(64), PARAMS) == reference
    assert engine.generate(_prompts(64), PARAMS) == reference
    assert engine.stats.cached_tokens > 0
    # the same layers, in order, once each
    m = result.manifest
    ranges = [(s.first_layer, s.stop_layer) for s in m.stages]
    assert ranges[0][0] == 0 and ranges[-1][1] == 4 and len(ranges) == stages
    assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, [*ranges[1:], (4, 5)], strict=True))


@pytest.mark.parametrize("stages", [2, 3])
def test_mla_moe_stages_give_the_unsplit_tokens(mla_moe, tmp_path, stages):
    result = split_model(mla_moe, tmp_path / "s", stages, verify=stages == 3)
    reference = _alone(mla_moe, 256)
    assert _engine(tmp_path / "s", max_num_batched_tokens=16).generate(_prompts(256), PARAMS) == reference
    # the boundary is one hidden state per cut, float32 [.., .., hidden]
    for spec in result.manifest.stages[1:]:
        assert len(spec.boundary_in) == 1 and spec.boundary_in[0].dtype == "float"
        assert spec.boundary_in[0].shape[-1] == 64


def _initializers(path: Path) -> dict[str, int]:
    model = onnx.load(str(path), load_external_data=False)
    out = {}
    for t in model.graph.initializer:
        length = {e.key: e.value for e in t.external_data}.get("length")
        out[t.name] = int(length) if length is not None else len(t.raw_data)
    return out


def test_each_stage_holds_only_its_own_weights(mla_moe, tmp_path):
    result = split_model(mla_moe, tmp_path / "s", 3, verify=False)
    source = _initializers(mla_moe)
    per_stage = [_initializers(result.folder / s.model) for s in result.manifest.stages]
    big = {n for n, b in source.items() if b >= 1024}
    # every large weight of the source is in exactly one stage, byte for byte the same
    owners = {n: [i for i, s in enumerate(per_stage) if n in s] for n in big}
    shared = {n: o for n, o in owners.items() if len(o) != 1}
    assert not shared, f"weights in more or fewer than one stage: {shared}"
    reference = onnx.load(str(mla_moe))
    arrays = {t.name: onnx.numpy_helper.to_array(t) for t in reference.graph.initializer if t.name in big}
    for spec in result.manifest.stages:
        staged = onnx.load(str(result.folder / spec.model))
        for t in staged.graph.initializer:
            if t.name in arrays:
                np.testing.assert_array_equal(onnx.numpy_helper.to_array(t), arrays[t.name])
        # the embedding in stage 0, the head in the last; each stage's caches are its own layers'
        assert spec.cache_inputs == tuple(f"past_key_values.{k}.key" for k in range(spec.first_layer, spec.stop_layer))
    assert "inner.model.embed_tokens.weight" in per_stage[0]
    assert "inner.model.norm.weight" in per_stage[-1]  # the final norm (the head's weight has no name of its own)
    assert not any("embed_tokens" in n for s in per_stage[1:] for n in s)
    # the data files hold those weights and little else (64-byte alignment)
    for i, spec in enumerate(result.manifest.stages):
        data = sum(b for n, b in per_stage[i].items() if b >= 1024)
        assert data <= spec.files[1].bytes <= data + 64 * len(per_stage[i])


def test_stages_are_balanced_by_weight_bytes(tmp_path):
    """A learned position table (256 KB, read before layer 0) makes stage 0 heavy: it gets one layer, not two."""
    cfg = ToyLMConfig(num_layers=4, position_ids=True, max_positions=1024, seed=3)
    onnx.save(build_toy_lm(cfg), tmp_path / "m.onnx")
    result = split_model(tmp_path / "m.onnx", tmp_path / "s", 2, verify=False)
    assert [(s.first_layer, s.stop_layer) for s in result.manifest.stages] == [(0, 1), (1, 4)]
    sizes = {t.name: t.raw_data for t in onnx.load(str(tmp_path / "m.onnx")).graph.initializer}
    layer = sum(len(sizes[f"layers.0.{w}"]) for w in ("wq", "wk", "wv", "wo"))
    tables = len(sizes["cos_cache"]) + len(sizes["sin_cache"])  # RoPE tables: every stage's attention reads them
    head = len(sizes["lm_head"])
    assert result.manifest.stages[1].weight_bytes == 3 * layer + tables + head + 4 + 8 + 8  # + the index constants


def test_a_layer_boundary_no_single_value_cuts_is_refused(tmp_path):
    """The embedding read again after the last layer (a second stream past every cut): refused with the reason."""
    model = build_toy_lm(ToyLMConfig(num_layers=2, logits="all", attention_metadata=False))
    lm_head = next(n for n in model.graph.node if n.name == "lm_head")
    skip = onnx.helper.make_node("Add", [lm_head.input[0], "x0"], ["x_skip"], name="skip_from_embedding")
    lm_head.input[0] = "x_skip"
    nodes = list(model.graph.node)
    nodes.insert(nodes.index(lm_head), skip)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    onnx.save(model, tmp_path / "m.onnx")
    with pytest.raises(SplitRefused, match="before layer\\(s\\) \\[1\\] no single value"):
        split_model(tmp_path / "m.onnx", tmp_path / "s", 2)
    assert not (tmp_path / "s").exists()
    assert list(tmp_path.iterdir()) == [tmp_path / "m.onnx"]  # no staging folder left behind


def test_too_many_stages_and_dense_models_are_refused(toy, tmp_path):
    with pytest.raises(SplitRefused, match="expected 1 to 4 stages"):
        split_model(toy, tmp_path / "s", 5)
    dense = FIXTURES / "llama_sdpa_op18.onnx"
    with pytest.raises(SplitRefused, match="no PagedAttention node"):
        split_model(dense, tmp_path / "s", 2)


def test_a_folder_that_disagrees_with_its_manifest_is_refused_naming_the_file(toy, tmp_path):
    folder = split_model(toy, tmp_path / "s", 2, verify=False).folder
    read_stage_folder(folder, hashes=True)  # as written: accepted
    data = folder / "stage_1.onnx.data"
    blob = bytearray(data.read_bytes())
    blob[100] ^= 0xFF  # same size, one byte changed
    data.write_bytes(bytes(blob))
    read_stage_folder(folder)  # sizes alone cannot see it
    with pytest.raises(InvalidModel, match=r"stage_1\.onnx\.data: SHA-256 differs"):
        read_stage_folder(folder, hashes=True)
    with pytest.raises(InvalidModel, match=r"stage_1\.onnx\.data: SHA-256 differs"):
        StageChain(folder, num_blocks=8, block_size=BS)  # a stage checks its own files before opening
    data.write_bytes(bytes(blob[:-8]))
    with pytest.raises(InvalidModel, match=r"stage_1\.onnx\.data: \d+ bytes, the manifest says"):
        read_stage_folder(folder)
    data.unlink()
    with pytest.raises(InvalidModel, match=r"stage_1\.onnx\.data: missing"):
        Engine(folder, num_blocks=8, block_size=BS, stages="local")
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["stages"][1]["first_layer"] += 1
    (folder / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(InvalidModel, match="do not tile layers"):
        read_stage_folder(folder)


def test_cli_split_and_convert_with_stages(tmp_path, capsys):
    from ortpa.cli import main

    shutil.copy(FIXTURES / "llama_sdpa_op18.onnx", tmp_path / "dense.onnx")
    assert main(["convert", str(tmp_path / "dense.onnx"), str(tmp_path / "paged.onnx"), "--stages", "2"]) == 0
    out = capsys.readouterr().out
    assert "stage 1: layers 1..1" in out and "verified: the stages reproduce the unsplit model" in out
    assert read_stage_folder(tmp_path / "paged.onnx.stages", hashes=True).layers == 2
    assert main(["split", str(tmp_path / "paged.onnx"), str(tmp_path / "again"), "--stages", "2", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert [s["layers"] for s in printed["stages"]] == [[0, 1], [1, 2]]
    assert printed["proof"]["max_error"] <= printed["proof"]["bound"]
    assert main(["split", str(tmp_path / "paged.onnx"), str(tmp_path / "again"), "--stages", "2"]) == 1
    assert "exists and is not an empty folder" in capsys.readouterr().err
