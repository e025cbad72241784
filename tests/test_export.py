"""Live exports (the `export` extra, which CI installs): export -> convert -> parity against PyTorch itself.

Nothing here skips for a missing library: without torch/transformers these tests fail at import, as they should
in CI. Two further exports (a bf16 checkpoint kept in its dtype, a real torch.onnx failure) are ``slow``.
"""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from support.parity import run_parity
from support.torch_reference import TorchModel, export_matches_torch

from ortpa.errors import UnsupportedModel
from ortpa.export.hf import build_model, export_hf
from ortpa.export.rope_support import refuse_unrepresentable_rope
from ortpa.rewriter.pipeline import convert

pytestmark = pytest.mark.export

# One layer, MoE (first_k_dense_replace=0) with DeepSeek-V2-Lite's shape of attention (no q LoRA) and complex
# RoPE: both export patches (grouped_mm lowering, real-valued RoPE) in the smallest graph that has them.
_DSV2_LITE_1L = {
    "model_type": "deepseek_v2",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": None,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "first_k_dense_replace": 0,
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "topk_method": "greedy",
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
}


def test_export_convert_parity_against_pytorch(tmp_path):
    info = export_hf(_DSV2_LITE_1L, tmp_path / "m.onnx")
    assert info["output_names"] == ["logits", "present.0.key", "present.0.value"]
    assert info["real_rope"] is True and info["experts_implementation"] == "grouped_mm"
    model = build_model(_DSV2_LITE_1L)
    assert export_matches_torch(tmp_path / "m.onnx", model) < 1e-4
    converted = convert(str(tmp_path / "m.onnx"))
    assert sum(n.op_type == "PagedAttention" for n in converted.graph.node) == 1
    result = run_parity(converted, None, reference=TorchModel(model), allow_ties=False, scatter_blocks=True)
    assert result.tokens_checked == 24


def _save_two_shards(folder, dtype=torch.bfloat16) -> torch.nn.Module:
    cfg = {**_DSV2_LITE_1L, "model_type": "deepseek_v3", "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
    model = build_model(cfg, seed=3).to(dtype)
    model.save_pretrained(folder, max_shard_size="100KB")
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) >= 2 and (folder / "model.safetensors.index.json").is_file(), shards
    return model


@pytest.mark.slow  # a third export (~25 s alone on 2 cores); the default run exports the checkpoint in float32
def test_checkpoint_exported_in_its_dtype_with_its_weights(tmp_path):
    """A sharded bf16 checkpoint exported in bf16 (asked for) keeps the stored weights, bit for bit, in external
    data."""
    folder = tmp_path / "ckpt"
    model = _save_two_shards(folder)
    info = export_hf(folder, tmp_path / "m.onnx", random_weights=False, external_data=True, dtype="bfloat16")
    assert info["dtype"] == "bfloat16" and (tmp_path / "m.onnx.data").is_file()
    proto = onnx.load(str(tmp_path / "m.onnx"))
    inits = {i.name.removeprefix("inner."): i for i in proto.graph.initializer}
    # every parameter once, under its own name, bit for bit as stored (no transposed copies)
    for name, p in model.named_parameters():
        assert inits[name].data_type == onnx.TensorProto.BFLOAT16, name
        got = onnx.numpy_helper.to_array(inits[name]).astype(np.float32)
        assert np.array_equal(got, p.detach().float().numpy()), name
    big = [i for i in proto.graph.initializer if np.prod(i.dims) > 64]
    assert len(big) == sum(1 for _, p in model.named_parameters() if p.numel() > 64)


def test_convert_hf_folder_then_generate_text(tmp_path, capsys):
    """`ortpa convert HF_DIR OUT` with no flags exports a bfloat16 two-shard checkpoint in float16 (the default for
    bfloat16: ONNX Runtime's CPU lacks bfloat16 kernels) then converts (parity, within float16 tolerance, with the
    checkpoint's weights run by PyTorch in float32); `ortpa generate OUT --prompt` finds the copied tokenizer,
    prints text and stops at generation_config's EOS."""
    from support.tokenizer_fixture import write_tokenizer

    from ortpa.cli import main

    folder = tmp_path / "ckpt"
    _save_two_shards(folder, torch.bfloat16)
    tokenizer = write_tokenizer(folder / "tokenizer.json", vocab_size=256)
    out = tmp_path / "out" / "paged.onnx"
    assert main(["convert", str(folder), str(out)]) == 0
    err = capsys.readouterr().err
    assert err.index("exporting") < err.index("absorbing layer 0") and "torch.float16" in err, err
    assert "stored bfloat16, exporting in float16" in err, err
    assert (out.parent / "tokenizer.json").is_file()
    # the output folder holds the deployment only: the dense export went to a temporary folder, now removed; its
    # weights were streamed into external data, which the converted model keeps
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "config.json",
        "genai_config.json",
        "generation_config.json",
        "paged.onnx",
        "paged.onnx.data",
        "tokenizer.json",
    ], sorted(p.name for p in out.parent.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "out"]

    reference = TorchModel(build_model(folder, random_weights=False, dtype="float32"))
    result = run_parity(onnx.load(str(out)), None, reference=reference, allow_ties=False)
    assert result.tokens_checked == 24

    # EOS: the first token the model generates for this prompt, so generation stops right after it
    ids = tokenizer.encode("hello world").ids
    first = int(reference.step(reference.new(), ids).argmax())
    (out.parent / "generation_config.json").write_text(json.dumps({"eos_token_id": [first]}))
    assert main(["generate", str(out), "--prompt", "hello world", "--max-new-tokens", "5", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["outputs"] == [[first]] and printed["texts"] == [""]
    (out.parent / "generation_config.json").write_text(json.dumps({"eos_token_id": 255 if first != 255 else 254}))
    assert main(["generate", str(out), "--prompt", "hello world", "--max-new-tokens", "3", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    (tokens,) = printed["outputs"]
    assert tokens[0] == first and printed["texts"] == [tokenizer.decode([t for t in tokens if t != 255])]


@pytest.mark.slow  # a fourth export; test_export_patches checks the same line from a synthetic failure, fast
def test_failed_export_is_one_line(tmp_path, capsys, monkeypatch):
    """Without the grouped_mm lowering the MoE layer cannot be exported: one line naming the op and a remedy."""
    import ortpa.export.patches as patches
    from ortpa.cli import main

    monkeypatch.setattr(patches, "translation_table", lambda: {})
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**_DSV2_LITE_1L, "model_type": "deepseek_v3", "n_group": 1, "topk_group": 1}))
    assert main(["export", str(config), str(tmp_path / "p.onnx"), "--random-weights", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("ortpa export: error:") and "grouped_mm" in err[0] and "--experts batched_mm" in err[0]
    assert "(in model.layers.0.mlp.experts (DeepseekV3Experts), modeling_deepseek_v3.py:" in err[0]


def test_dynamic_rope_is_refused_up_front_in_one_line(tmp_path, capsys):
    """Dynamic NTK RoPE takes its frequencies from the longest position in the batch: refused before any export
    (ortpa.export.rope_support), exit code 1, one line naming the scaling and why; nothing written."""
    from ortpa.cli import main

    rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 16}
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "vocab_size": 256,
                "rope_parameters": rope,
            }
        )
    )
    assert main(["export", str(config), str(tmp_path / "p.onnx"), "--random-weights", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "RoPE scaling 'dynamic' (dynamic NTK) is not converted" in err[0] and "longest position" in err[0]
    assert not (tmp_path / "p.onnx").exists()
    with pytest.raises(UnsupportedModel) as info:
        export_hf(json.loads(config.read_text()), tmp_path / "q.onnx")
    assert info.value.mixes_sequences
    # static scalings pass the check (their exports: tests/testing/test_sweep.py), per layer type too
    refuse_unrepresentable_rope({"rope_parameters": {**rope, "rope_type": "linear"}}, "static")
    with pytest.raises(UnsupportedModel, match="'dynamic'"):
        refuse_unrepresentable_rope(
            {"rope_parameters": {"full_attention": rope, "sliding": {"rope_type": "default"}}}, "x"
        )
