"""Checkpoints as they ship: bfloat16 and FP8 block-quantized folders converted with no flags run on CPU with
PyTorch's tokens; the conversion's ONNX Runtime check refuses what cannot run where the model is meant to.

Folders are written from tiny configs in the shipped layouts (:mod:`ortpa.testing.checkpoints`). The bfloat16 case of
the default run is ``test_export.py::test_convert_hf_folder_then_generate_text``; here the FP8 one, the check,
quiet output, and (``slow``) every MLA family in both stored dtypes.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from support.parity import FIXTURES, run_parity
from support.torch_reference import TorchModel

from ortpa.cli import main
from ortpa.export.checkpoint_dtype import default_export_dtype, stored_dtype
from ortpa.export.fp8 import dequantize_blocks, fp8_spec
from ortpa.export.hf import build_model
from ortpa.rewriter.dtype import convert_float_type
from ortpa.testing.checkpoints import _dequantize, fp8_reference_folder, save_checkpoint, save_fp8_checkpoint

pytestmark = pytest.mark.export

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ([5, 17, 3, 99, 42], [7, 8], [200, 1, 64, 9, 31, 250, 12, 77, 5, 6, 18])

# One DeepSeek-V3 MoE layer (routed and shared experts) with dimensions past one 128x128 block, none a multiple of
# 128: the FP8 scale grid has partial blocks in both directions (kv_a_proj_with_mqa: 144 x 160 -> 2 x 2 blocks,
# the last 16 x 32). The slow matrix below adds a dense layer 0 and the other families.
_DSV3_FP8 = {
    "model_type": "deepseek_v3",
    "vocab_size": 256,
    "hidden_size": 160,
    "intermediate_size": 192,
    "moe_intermediate_size": 48,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 144,
    "kv_lora_rank": 128,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "first_k_dense_replace": 0,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def _greedy(reference: TorchModel, prompt: list[int], n: int) -> list[int]:
    state, ids, out = reference.new(), list(prompt), []
    for _ in range(n):
        token = int(reference.step(state, ids).argmax())
        out.append(token)
        ids = [token]
    return out


def _generate(model: Path, n: int, capsys) -> list[list[int]]:
    args = ["generate", str(model), "--max-new-tokens", str(n), "--json", "--provider", "cpu"]
    for prompt in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, prompt))]
    capsys.readouterr()
    assert main(args) == 0
    return json.loads(capsys.readouterr().out)["outputs"]


def _converts_with_pytorch_tokens(folder: Path, reference_folder: Path, out: Path, capsys) -> str:
    """`ortpa convert folder out` with no flags, then parity and `ortpa generate` on CPU against the checkpoint
    run in float32 by transformers; returns the progress lines."""
    assert main(["convert", str(folder), str(out)]) == 0
    err = capsys.readouterr().err
    reference = TorchModel(build_model(reference_folder, random_weights=False, dtype="float32"))
    # a whole float16 model (weights and activations) against float32: the float16 precision rule
    result = run_parity(
        onnx.load(str(out)),
        None,
        reference=reference,
        allow_ties=False,
        scatter_blocks=True,
    )
    assert result.tokens_checked == 24
    assert _generate(out, 6, capsys) == [_greedy(reference, p, 6) for p in PROMPTS]
    return err


# ------------------------------------------------------------------------------------------ FP8 units
def test_dequantize_blocks_partial_grid_experts_and_ue8m0():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(144, 160)).astype(ml_dtypes.float8_e4m3fn)
    scale = rng.uniform(0.01, 2.0, size=(2, 2)).astype(np.float32)
    fp8 = torch.from_numpy(w.view(np.uint8)).view(torch.float8_e4m3fn)
    got = dequantize_blocks(fp8, torch.from_numpy(scale), (128, 128)).numpy()
    np.testing.assert_array_equal(got, _dequantize(w, scale, (128, 128)))
    assert got[130, 150] == np.float32(w[130, 150]) * scale[1, 1] and got[5, 150] == np.float32(w[5, 150]) * scale[0, 1]
    # stacked experts [E, rows, cols] with [E, grid] scales
    stacked = dequantize_blocks(torch.stack([fp8, fp8]), torch.from_numpy(np.stack([scale, 2 * scale])), (128, 128))
    np.testing.assert_array_equal(stacked[1].numpy(), 2 * got)
    # ue8m0 scales: one exponent byte per block, 2 ** (byte - 127)
    ue8m0 = torch.tensor([[127, 128], [126, 130]], dtype=torch.uint8)
    got = dequantize_blocks(fp8, ue8m0, (128, 128)).numpy()
    np.testing.assert_array_equal(got, _dequantize(w, np.array([[1, 2], [0.5, 8]], np.float32), (128, 128)))
    with pytest.raises(ValueError, match=r"scale grid \(1, 2\) does not fit weight \(144, 160\)"):
        dequantize_blocks(fp8, torch.ones(1, 2), (128, 128))


def test_stored_and_default_export_dtypes(tmp_path):
    cases = {
        "bf16": ({"dtype": "bfloat16"}, "bfloat16", "float16"),
        "fp16": ({"torch_dtype": "float16"}, "float16", "float16"),
        "fp32": ({}, "float32", "float32"),
        "fp8": (
            {"dtype": "bfloat16", "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 32]}},
            "fp8",
            "float16",
        ),
    }
    for name, (config, stored, exported) in cases.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "llama", **config}))
        assert stored_dtype(tmp_path / name) == stored, name
        assert default_export_dtype(stored) == exported, name
        assert default_export_dtype(stored, "bfloat16") == "bfloat16"
    assert fp8_spec(tmp_path / "fp8").block == (64, 32) and fp8_spec(tmp_path / "bf16") is None


# ------------------------------------------------------------------------------------------ FP8 end to end
def test_fp8_checkpoint_converts_with_no_flags_and_generates_pytorch_tokens(tmp_path, capsys):
    """DeepSeek-V3's FP8 layout (sharded, index, weight_scale_inv, quantization_config; MoE experts per expert):
    `ortpa convert` dequantizes it itself (no accelerate), exports float16, and the paged model's tokens on CPU
    are those of the checkpoint's weights (FP8 times scale, computed here by NumPy) run in float32."""
    folder = tmp_path / "fp8"
    assert save_fp8_checkpoint(build_model(_DSV3_FP8, seed=7), folder) == 5 + 4 * 3 + 3
    reference = fp8_reference_folder(folder, tmp_path / "reference")
    out = tmp_path / "out" / "model.onnx"
    err = _converts_with_pytorch_tokens(folder, reference, out, capsys)
    from ortpa.runtime.device import has_cuda

    assert "stored fp8, exporting in float16" in err, err
    assert ("not checked on CUDA: no CUDA device" in err) == (not has_cuda()), err  # said, never passed silently
    assert not list(out.parent.glob(".ortpa-dequantized*")), "the dequantized scratch copy is removed"


# ------------------------------------------------------------------------------------------ the check
@pytest.fixture(scope="module")
def bf16_dense(tmp_path_factory) -> Path:
    """A committed float32 export cast to bfloat16 (as a bfloat16 export would be): ORT's CPU cannot run it."""
    path = tmp_path_factory.mktemp("bf16") / "dense.onnx"
    model = ir.load(str(FIXTURES / "dsv3_moe_sdpa_op18.onnx"))
    convert_float_type(model, ir.DataType.BFLOAT16)
    ir.save(model, str(path))
    return path


def test_check_refuses_bfloat16_on_cpu_naming_the_op(bf16_dense, tmp_path, capsys):
    out = tmp_path / "out" / "paged.onnx"
    assert main(["convert", str(bf16_dense), str(out), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.search(r"cannot run on CPU: ONNX Runtime has no bfloat16 kernel for \w+\(\d+\) \(\d+ node", err[0]), err
    assert "--dtype float16" in err[0] and "--providers cuda" in err[0]
    assert not out.parent.exists(), "nothing written"
    # meant for CUDA only: this CPU machine cannot verify it, so it is written only when verification is skipped
    # (checked on CUDA where a device is present)
    assert main(["convert", str(bf16_dense), str(out), "--quiet", "--providers", "cuda"]) == 1
    assert "cannot verify the converted model on this machine" in capsys.readouterr().err
    assert main(["convert", str(bf16_dense), str(out), "--quiet", "--providers", "cuda", "--no-verify"]) == 0
    assert out.is_file()
    # --dtype float16: the same model at 2 bytes a weight, runs on CPU, and is verified there: the bfloat16
    # original itself cannot run here, but a half original's reference is its float32 twin, which can
    cpu = tmp_path / "cpu" / "paged.onnx"
    assert main(["convert", str(bf16_dense), str(cpu), "--quiet", "--dtype", "float16", "--json"]) == 0
    verification = json.loads(capsys.readouterr().out)["verification"]
    assert verification["ok"] and verification["structure"]["twin"], verification
    assert verification["structure"]["arithmetic"] == "float32", verification
    weights = [i for i in onnx.load(str(cpu)).graph.initializer if len(i.raw_data) > 4096]
    assert weights and {i.data_type for i in weights} == {onnx.TensorProto.FLOAT16}
    outputs = _generate(cpu, 4, capsys)
    assert [len(o) for o in outputs] == [4, 4, 4]


def test_bfloat16_export_for_cpu_is_refused_before_exporting(tmp_path, capsys):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "dtype": "bfloat16"}))
    out = tmp_path / "out" / "m.onnx"
    assert main(["convert", str(folder), str(out), "--export-dtype", "bfloat16", "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bfloat16 export cannot run on CPU" in err[0] and "--providers cuda" in err[0], err
    assert not out.parent.exists()


# ------------------------------------------------------------------------------------------ quiet output
def test_library_chatter_only_with_verbose(tmp_path):
    """onnxscript's "Skipping constant folding ..." warnings come between ortpa's lines only with --verbose (a
    process of its own: pytest's log capture would hide them either way)."""

    def convert(*extra: str) -> list[str]:
        out = tmp_path / f"out{len(extra)}.onnx"
        cmd = [sys.executable, "-m", "ortpa", "convert", str(FIXTURES / "dsv3_moe_sdpa_op18.onnx"), str(out), *extra]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=True)
        return done.stderr.splitlines()

    quiet = convert()
    # ortpa's own lines only: progress (indented) and its notes
    assert quiet and all(line.startswith(("  ", "ortpa convert: note:")) for line in quiet), quiet
    # unverified: the warnings come from the rewrite's optimizer; the quiet run above covers verification's output
    assert any("Skipping constant folding" in line for line in convert("--verbose", "--no-verify"))


# ------------------------------------------------------------------------------------------ every family (slow)
_FAMILIES = ["dsv2lite_moe_sdpa_op18", "dsv3_moe_sdpa_op18", "minicpm3_sdpa_op18"]


@pytest.mark.slow  # one export each (~30-120 s on 2 cores)
@pytest.mark.parametrize("stored", ["bfloat16", "fp8"])
@pytest.mark.parametrize("name", _FAMILIES)
def test_family_checkpoint_converts_with_no_flags(name, stored, tmp_path, capsys):
    config = json.loads((FIXTURES / f"{name}.json").read_text())["config"]
    folder = tmp_path / "ckpt"
    model = build_model(config, seed=5)
    if stored == "fp8":
        assert save_fp8_checkpoint(model, folder) > 0
        reference = fp8_reference_folder(folder, tmp_path / "reference")
    else:
        save_checkpoint(model, folder, torch.bfloat16)
        reference = folder
    err = _converts_with_pytorch_tokens(folder, reference, tmp_path / "out" / "model.onnx", capsys)
    assert f"stored {stored}, exporting in float16" in err, err


def test_dequantized_copy_of_a_single_file_checkpoint(tmp_path):
    """One ``model.safetensors`` (no index), a per-tensor scale and a bfloat16 tensor: the copy holds the weights
    times their scales in the asked dtype, no scales, and a config without quantization_config."""
    from safetensors.torch import load_file, save_file

    from ortpa.export.fp8 import dequantized_copy

    folder = tmp_path / "ckpt"
    folder.mkdir()
    w = torch.tensor([[1.0, -2.0, 0.5], [448.0, 3.0, -0.25]]).to(torch.float8_e4m3fn)
    norm = torch.tensor([1.5, 2.25], dtype=torch.bfloat16)
    save_file(
        {"a.weight": w, "a.weight_scale_inv": torch.tensor(0.5), "norm.weight": norm}, str(folder / "model.safetensors")
    )
    config = {"model_type": "llama", "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    (folder / "config.json").write_text(json.dumps(config))
    with dequantized_copy(folder, fp8_spec(folder), "float32", scratch_parent=tmp_path / "scratch") as copy:
        got = load_file(str(copy / "model.safetensors"))
        assert sorted(got) == ["a.weight", "norm.weight"]
        torch.testing.assert_close(got["a.weight"], w.float() * 0.5, rtol=0, atol=0)
        torch.testing.assert_close(got["norm.weight"], norm.float(), rtol=0, atol=0)
        assert "quantization_config" not in json.loads((copy / "config.json").read_text())
    assert not list((tmp_path / "scratch").iterdir()), "the scratch copy is removed"


def test_random_checkpoint_holds_one_shard_at_a_time(tmp_path, monkeypatch):
    """write_random_checkpoint makes checkpoints larger than memory: a shard's tensors are gone once it is saved
    (it once kept every shard alive, and a 26 GB checkpoint was killed for memory at 20 GB)."""
    import gc
    import weakref

    from ortpa.testing import checkpoints

    saved: list[list[weakref.ref]] = []
    real_save = checkpoints.save_file

    def save(tensors, path, metadata=None):
        gc.collect()
        alive = [ref for shard in saved for ref in shard if ref() is not None]
        assert not alive, f"{len(alive)} tensors of earlier shards still alive"
        saved.append([weakref.ref(t) for t in tensors.values()])
        return real_save(tensors, path, metadata=metadata)

    monkeypatch.setattr(checkpoints, "save_file", save)
    config = dict(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)  # fmt: skip
    checkpoints.write_random_checkpoint(config, tmp_path / "ckpt", shard_bytes=16 << 10)
    assert len(saved) >= 3
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(saved) == len(list((tmp_path / "ckpt").glob("*.safetensors")))
