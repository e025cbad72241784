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

__all__ = [
    "checkpoint_bytes",
    "fp8_reference_folder",
    "is_fp8_weight",
    "save_checkpoint",
    "save_fp8_checkpoint",
    "write_random_checkpoint",
]

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


def _layout(config: dict):
    """(transformers config, checkpoint tensor name -> shape) of ``config``, from a meta model (nothing allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    cfg = dict(config)
    hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    layout = revert_weight_conversion(model, model.state_dict())
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {}) if hf_config.tie_word_embeddings else set()
    return hf_config, {name: tuple(t.shape) for name, t in layout.items() if name not in tied}


def checkpoint_bytes(config: dict, *, fp8: bool = False) -> int:
    """What :func:`write_random_checkpoint` writes for ``config``, in bytes (scales included), without writing it."""
    total = 0
    for name, shape in _layout(config)[1].items():
        n = math.prod(shape)
        if fp8 and is_fp8_weight(name, len(shape)):
            total += n + 4 * math.ceil(shape[0] / 128) * math.ceil(shape[1] / 128)
        else:
            total += 2 * n
    return total


def write_random_checkpoint(
    config: dict, folder: Path, *, fp8: bool = False, shard_bytes: int = 256 * 2**20, seed: int = 0
) -> int:
    """A sharded bfloat16 (or FP8, as :func:`save_fp8_checkpoint` lays it out) safetensors checkpoint of ``config``
    with random weights, written one shard at a time: never the model in memory (a shard's tensors at most), so
    checkpoints larger than the machine's memory can be made. Names and shapes are the checkpoint layout
    transformers saves (per-expert MoE weights). Returns the bytes written."""
    hf_config, shapes = _layout(config)
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shard: dict[str, torch.Tensor] = {}  # the one shard in memory; dropped once saved
    count = size = written = 0
    weight_map: dict[str, str] = {}
    names = sorted(shapes)

    def flush() -> None:
        nonlocal shard, count, size, written
        count += 1
        name = f"model-{count:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        written += size
        shard, size = {}, 0

    for name in names:
        shape = shapes[name]
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            w = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            w = rng.standard_normal(shape, dtype=np.float32) / max(shape[-1], 1) ** 0.5
        if fp8 and is_fp8_weight(name, len(shape)):
            q, scale = _quantize(w, (128, 128))
            tensors = {name: torch.from_numpy(q.view(np.uint8)).view(torch.float8_e4m3fn)}
            tensors[name + "_scale_inv"] = torch.from_numpy(scale)
        else:
            tensors = {name: torch.from_numpy(w).to(torch.bfloat16)}
        for key, tensor in tensors.items():
            shard[key] = tensor
            size += tensor.numel() * tensor.element_size()
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    files = sorted(set(weight_map.values()))
    total = len(files)
    renamed = {f: f"model-{i + 1:05d}-of-{total:05d}.safetensors" for i, f in enumerate(files)}
    for old, new in renamed.items():
        (folder / old).rename(folder / new)
    index = {"metadata": {"total_size": written}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    saved = hf_config.to_dict()
    saved["dtype"] = "bfloat16"
    if fp8:
        saved["quantization_config"] = {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]
        }  # fmt: skip
    (folder / "config.json").write_text(json.dumps(saved, indent=1))
    return written
