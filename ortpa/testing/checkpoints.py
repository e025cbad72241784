"""Checkpoint folders in the layouts they ship in, written from tiny random configs (needs the `export` extra).

* :func:`save_checkpoint`: ``save_pretrained`` in a stored dtype, two or more safetensors shards with an index.
* :func:`save_fp8_checkpoint`: DeepSeek-V3/R1 / Kimi-K2's FP8 layout: every Linear weight of the decoder layers
  (attention projections, dense MLP, routed and shared experts) as ``float8_e4m3fn`` with a float32
  ``<name>_scale_inv`` beside it (one scale per 128x128 block, the grid rounded up), embeddings, norms, router
  and ``lm_head`` in bfloat16, ``quantization_config`` in ``config.json``; sharded with an index.

The float32 reference of an FP8 folder is computed here, with NumPy, from the bytes written (not by ortpa's
dequantizer): :func:`fp8_reference_folder` writes it as a plain float32 checkpoint that transformers loads.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

__all__ = ["fp8_reference_folder", "is_fp8_weight", "save_checkpoint", "save_fp8_checkpoint"]

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def save_checkpoint(model: torch.nn.Module, folder: Path, dtype: torch.dtype, shard: str = "100KB") -> None:
    model.to(dtype).save_pretrained(folder, max_shard_size=shard)
    assert len(list(folder.glob("*.safetensors"))) >= 2 and (folder / "model.safetensors.index.json").is_file()


def is_fp8_weight(name: str, ndim: int) -> bool:
    """Which tensors DeepSeek-V3's FP8 checkpoint stores in FP8: the decoder layers' Linear weights."""
    return (
        name.startswith("model.layers.")
        and name.endswith(".weight")
        and ndim == 2
        and "norm" not in name
        and not name.endswith("mlp.gate.weight")
    )


def _quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = w.shape
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    scale = np.zeros(grid, np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            tile = w[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]]
            s = max(float(np.abs(tile).max()), 1e-12) / FP8_MAX
            scale[i, j] = s
            q[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] = (tile / s).astype(q.dtype)
    return q, scale


def _dequantize(q: np.ndarray, scale: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    out = q.astype(np.float32)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0] : (i + 1) * block[0], j * block[1] : (j + 1) * block[1]] *= scale[i, j]
    return out


def save_fp8_checkpoint(
    model: torch.nn.Module, folder: Path, block: tuple[int, int] = (128, 128), shard: str = "100KB"
) -> int:
    """``model`` saved as a bf16 checkpoint (shards of at most ``shard``), then every FP8 weight rewritten with
    its scales, shard by shard. Returns how many weights are FP8."""
    save_checkpoint(model, folder, torch.bfloat16, shard)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    count = 0
    for shard in sorted(set(index["weight_map"].values())):
        tensors = {}
        with safe_open(str(folder / shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if is_fp8_weight(name, t.ndim):
                    q, scale = _quantize(t.float().numpy(), block)
                    tensors[name] = torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)
                    tensors[name + "_scale_inv"] = torch.from_numpy(scale)
                    index["weight_map"][name + "_scale_inv"] = shard
                    count += 1
                else:
                    tensors[name] = t
        save_file(tensors, str(folder / shard), metadata={"format": "pt"})
    index_path.write_text(json.dumps(index, indent=1))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    return count


def fp8_reference_folder(fp8_folder: Path, out: Path) -> Path:
    """The FP8 folder's weights as the checkpoint means them (FP8 value times its block's scale, in float32),
    saved as a plain float32 checkpoint transformers loads with its usual key conversions."""
    out.mkdir(parents=True)
    config = json.loads((fp8_folder / "config.json").read_text())
    block = tuple(config.pop("quantization_config")["weight_block_size"])
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config))
    tensors = {}
    for shard in sorted(fp8_folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                if name.endswith("_scale_inv"):
                    continue
                t = f.get_tensor(name)
                if t.dtype == torch.float8_e4m3fn:
                    q = t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
                    with safe_open(str(shard), framework="pt") as g:  # the scale sits in the weight's shard
                        scale = g.get_tensor(name + "_scale_inv").numpy()
                    tensors[name] = torch.from_numpy(_dequantize(q, scale, block))
                else:
                    tensors[name] = t.float()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
