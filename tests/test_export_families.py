"""MLA families as they ship (MoE layers, DeepSeek-V2's complex RoPE): the committed exports equal PyTorch, and
convert to PagedAttention LATENT with parity under continuous batching (``scripts/make_fixtures.py`` makes them).
"""

from __future__ import annotations

import json

import onnx
import pytest
from support.parity import FIXTURES, run_parity
from support.torch_reference import export_matches_torch

from ortpa.export.hf import build_model
from ortpa.rewriter.pipeline import convert

FAMILIES = [
    "dsv3_moe_sdpa_op18",
    "dsv2_moe_sdpa_op18",
    "dsv2lite_moe_sdpa_op18",
    "kimi_moe_sdpa_op18",
    "glm4moelite_moe_sdpa_op18",
    "minicpm3_sdpa_op18",
]


def _info(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


@pytest.mark.export
@pytest.mark.parametrize("name", FAMILIES)
def test_fixture_equals_pytorch(name):
    """The committed export and the model rebuilt from its recorded config and seed agree within 1e-4."""
    model = build_model(_info(name)["config"])
    assert export_matches_torch(FIXTURES / f"{name}.onnx", model) >= 0.0


@pytest.mark.parametrize("name", FAMILIES)
def test_family_converts_with_parity(name):
    dense = FIXTURES / f"{name}.onnx"
    converted = convert(str(dense))
    assert sum(n.op_type == "PagedAttention" for n in converted.graph.node) == 2
    result = run_parity(converted, dense, allow_ties=False, scatter_blocks=True)
    assert result.tokens_checked == 24


@pytest.mark.parametrize("name", [n for n in FAMILIES if "moe" in n])
def test_moe_layer_is_in_the_graph(name):
    """Layer 1 is a MoE layer: transformers' grouped_mm lowering (one MatMul per expert, over Gathered rows)
    or, for DeepSeek-V2, its experts; the fixture would otherwise not test what its name says."""
    info = _info(name)
    model = onnx.load(str(FIXTURES / f"{name}.onnx"))
    ops = {n.op_type for n in model.graph.node}
    assert {"TopK", "Gather"} <= ops, sorted(ops)
    assert info.get("experts_implementation") == "grouped_mm"
    assert info.get("real_rope") == info["model_type"].startswith("deepseek_v2")


@pytest.mark.slow  # one export per family (~40-120 s each on 2 cores)
@pytest.mark.parametrize("name", FAMILIES)
def test_family_from_hf_folder(name, tmp_path):
    """Each family as a saved Hugging Face folder (safetensors, two shards): `ortpa convert HF_DIR OUT` exports it
    with its weights and converts it; the paged model matches the checkpoint run by PyTorch."""
    from support.torch_reference import TorchModel

    from ortpa.cli import main

    folder = tmp_path / "ckpt"
    build_model(_info(name)["config"], seed=5).save_pretrained(folder, max_shard_size="500KB")
    assert len(list(folder.glob("*.safetensors"))) >= 2
    out = tmp_path / "paged.onnx"
    assert main(["convert", str(folder), str(out), "--quiet"]) == 0
    reference = TorchModel(build_model(folder, random_weights=False))
    result = run_parity(onnx.load(str(out)), None, reference=reference, allow_ties=False, scatter_blocks=True)
    assert result.tokens_checked == 24
