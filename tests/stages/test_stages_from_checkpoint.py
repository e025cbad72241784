"""`ortpa convert HF_DIR OUT --stages N`: the stage folder written during the export, no unsplit model file.

The reference is `ortpa convert` of the same checkpoint into one paged file, driven by the same Engine on a batch
of prompts of different lengths (exact token equality); the output folder must hold the stage folder and nothing
else, and each stage data file only bytes its stage reads. The placement is checked from the checkpoint's headers
alone (no export), and the options a stage folder cannot honour are refused before any work.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from ortpa.conversion import ConvertOptions, convert_file
from ortpa.conversion.staged import convert_to_stages
from ortpa.errors import ConversionError, SplitRefused
from ortpa.runtime.engine import Engine, SamplingParams
from ortpa.runtime.stage_folder import read_stage_folder
from ortpa.stages.compact import SLACK, unread_bytes
from ortpa.stages.place import place_layers
from ortpa.testing.checkpoints import write_random_checkpoint

pytestmark = pytest.mark.export

LLAMA = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
             tie_word_embeddings=True)  # fmt: skip
DSV3 = dict(model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1, n_routed_experts=4,
            num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1, max_position_embeddings=128,
            tie_word_embeddings=False)  # fmt: skip
LENGTHS = [(3, 6), (17, 4), (9, 8), (1, 5)]
BS = 4


def _checkpoint(root: Path, config: dict) -> Path:
    folder = root / "ckpt"
    write_random_checkpoint(config, folder, shard_bytes=64 << 10)
    return folder


def _tokens(model: Path) -> list[list[int]]:
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(0, 256, size=n)] for n, _ in LENGTHS]
    kw = {"stages": "local"} if model.is_dir() else {}
    engine = Engine(model, block_size=BS, num_blocks=96, providers=["CPUExecutionProvider"], **kw)
    return engine.generate(prompts, [SamplingParams(max_new_tokens=m) for _, m in LENGTHS])


def _stages_equal_unsplit(ckpt: Path, tmp_path: Path, stages: int) -> None:
    from ortpa.cli import main

    out = tmp_path / "out"
    assert main(["convert", str(ckpt), str(out / "model.onnx"), "--stages", str(stages), "--quiet"]) == 0
    folder = out / "model.onnx.stages"
    # no unsplit model, dense export or side file anywhere: the output folder holds the stage folder only
    assert [p.name for p in out.iterdir()] == ["model.onnx.stages"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    manifest = read_stage_folder(folder, hashes=True)
    names = sorted(p.name for p in folder.iterdir())
    assert names == sorted(["config.json", "stages.json", *(f.name for s in manifest.stages for f in s.files)])
    assert len(manifest.stages) == stages and manifest.stages[-1].stop_layer == manifest.layers
    for spec in manifest.stages:
        size, unread = unread_bytes(folder, spec.model)
        assert unread <= SLACK * size, (spec.model, size, unread)
    unsplit = tmp_path / "unsplit" / "model.onnx"
    convert_file(ckpt, unsplit, ConvertOptions.of(verify=False, providers=("cpu",)))
    assert _tokens(folder) == _tokens(unsplit)


def test_placement_from_headers_balances_layers_and_places_every_weight(tmp_path):
    ckpt = _checkpoint(tmp_path, {**LLAMA, "num_hidden_layers": 6, "vocab_size": 2048})
    placement = place_layers(ckpt, 3)
    # six equal layers of 74 KB and a 262 KB embedding, which weighs on the first stage: it takes one layer
    assert placement.first_layers[:2] == (0, 1) and len(placement.first_layers) == 3
    assert max(placement.stage_bytes) == placement.stage_bytes[0]
    assert sum(placement.stage_bytes) == sum(
        2 * int(np.prod(s)) for s in _shapes(ckpt).values()
    )  # every weight counted once, in the dtype the export writes
    assert placement.stage_of("model.layers.3.mlp.up_proj.weight") == 1
    assert placement.stage_of("model.embed_tokens.weight") == 0
    assert placement.stage_of("model.embed_tokens.weight", transposed=True) == 2  # the tied output projection
    assert placement.stage_of("model.norm.weight") == 2
    with pytest.raises(SplitRefused, match="expected 1 to 6 stages"):
        place_layers(ckpt, 7)


def _shapes(ckpt: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    out = {}
    for shard in ckpt.glob("*.safetensors"):
        with safe_open(str(shard), framework="np") as f:
            for name in f.keys():
                out[name] = tuple(f.get_slice(name).get_shape())
    return out


def test_options_a_stage_folder_cannot_honour_are_refused_before_any_work(tmp_path):
    ckpt = _checkpoint(tmp_path, LLAMA)
    for fields, said in (({"portable": True}, "--portable"), ({"keep_dense": tmp_path / "d"}, "--keep-dense")):
        with pytest.raises(ConversionError, match=f"--stages with {said}: expected one or the other"):
            convert_to_stages(ckpt, tmp_path / "s", 2, **fields)
    dense = tmp_path / "dense"
    dense.mkdir()
    onnx.save(onnx.helper.make_model(onnx.helper.make_graph([], "g", [], [])), dense / "model.onnx")
    with pytest.raises(ConversionError, match="expected a Hugging Face checkpoint folder, found the ONNX model"):
        convert_to_stages(dense, tmp_path / "s", 2)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConversionError, match="expected a new or empty folder"):
        convert_to_stages(ckpt, tmp_path / "full", 2)
    assert not (tmp_path / "s").exists() and not (tmp_path / "d").exists()


@pytest.mark.slow  # two conversions of the checkpoint (~60-120 s on 2 shared cores)
def test_llama_stages_from_checkpoint_give_the_unsplit_tokens(tmp_path):
    _stages_equal_unsplit(_checkpoint(tmp_path / "src", LLAMA), tmp_path / "run", 2)


@pytest.mark.slow  # two conversions of the checkpoint (~60-120 s on 2 shared cores)
def test_deepseek_mla_moe_stages_from_checkpoint_give_the_unsplit_tokens(tmp_path):
    _stages_equal_unsplit(_checkpoint(tmp_path / "src", DSV3), tmp_path / "run", 3)
