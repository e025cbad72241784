"""FP8 block-quantized checkpoints (DeepSeek-V3/R1, Kimi-K2) dequantized by ortpa itself, one tensor at a time.

Such a folder stores most Linear weights as ``float8_e4m3fn`` with a ``<name>.weight_scale_inv`` tensor beside
each (float32, one scale per ``weight_block_size`` block, 128x128 as shipped; the grid is rounded *up*, so a
576-row ``kv_a_proj_with_mqa`` has 5 row blocks, the last one 64 rows), and ``config.json`` says
``quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size: [128, 128]}``.

Why not transformers' own loader: it needs ``accelerate``, and on a machine without a GPU it dequantizes with a
block size derived from ``rows // scale_rows``, which fails for 576 rows over 5 blocks and is wrong (silently)
for e.g. 160 rows over 2. Here the block size is the config's, the grid is checked against the weight's shape,
and every weight is dequantized in float32 and rounded once to the export's dtype.

:func:`dequantized_copy` streams the folder into a scratch folder of plain safetensors shards (same names, same
sharding, scales dropped, ``quantization_config`` removed), which transformers then loads like any checkpoint
with all its own key conversions (fused MoE experts...). Memory: one tensor at a time (the largest weight in
float32, plus its scale grid), never the model; disk: the dequantized copy, removed when the block exits.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortpa.errors import InvalidModel

__all__ = ["DROPPED_SUFFIXES", "SCALE_SUFFIX", "Fp8Spec", "dequantize_blocks", "dequantized_copy", "fp8_spec"]

SCALE_SUFFIX = "_scale_inv"
# tensors a dequantized checkpoint no longer needs: block scales and static activation scales
DROPPED_SUFFIXES = ("weight_scale_inv", ".activation_scale", ".input_scale")
_DTYPE_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}


@dataclass(frozen=True)
class Fp8Spec:
    """What a folder's ``quantization_config`` says: the weight format and the block shape of its scales."""

    fmt: str
    block: tuple[int, int]

    def describe(self) -> str:
        return f"FP8 {self.fmt} with {self.block[0]}x{self.block[1]} block scales"


def fp8_spec(folder: str | Path) -> Fp8Spec | None:
    """The folder's FP8 quantization (``quant_method: fp8``), ``None`` for any other checkpoint.

    Raises :class:`~ortpa.errors.InvalidModel` for an FP8 config ortpa cannot dequantize (another format or
    block shape), naming what it found."""
    config_path = Path(folder) / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError):
        return None
    quant = config.get("quantization_config") or {}
    if quant.get("quant_method") != "fp8":
        return None
    fmt = str(quant.get("fmt", "e4m3"))
    if fmt not in ("e4m3", "float8_e4m3fn"):
        raise InvalidModel(str(config_path), f"quantization_config fmt {fmt!r}: ortpa dequantizes e4m3 FP8 only")
    block = quant.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise InvalidModel(
            str(config_path), f"quantization_config weight_block_size must be two positive ints, got {block!r}"
        )
    return Fp8Spec(fmt="e4m3", block=(block[0], block[1]))


def dequantize_blocks(weight: Any, scale_inv: Any, block: tuple[int, int]):
    """``weight`` (float8, ``[..., rows, cols]``) times its per-block ``scale_inv``, in float32.

    ``scale_inv`` is ``[..., ceil(rows / block[0]), ceil(cols / block[1])]`` (the last blocks may be partial), a
    single scale (per-tensor FP8), or uint8 ``ue8m0`` exponents (``2 ** (byte - 127)``). Raises ``ValueError``
    when the grid does not fit the weight's shape."""
    import torch

    w = weight.to(torch.float32)
    s = (scale_inv.to(torch.float32) - 127.0).exp2() if scale_inv.dtype == torch.uint8 else scale_inv.float()
    if s.numel() == 1:
        return w.mul_(s.reshape(()))
    rows, cols = w.shape[-2:]
    grid = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(s.shape[-2:]) != grid or s.shape[:-2] != w.shape[:-2]:
        raise ValueError(
            f"scale grid {tuple(s.shape)} does not fit weight {tuple(w.shape)} in {block[0]}x{block[1]} blocks "
            f"(expected {(*w.shape[:-2], *grid)})"
        )
    full = s.repeat_interleave(block[0], dim=-2)[..., :rows, :].repeat_interleave(block[1], dim=-1)[..., :cols]
    return w.mul_(full)


def _shards(folder: Path) -> tuple[list[str], dict[str, str]]:
    """(shard file names in order, tensor name -> shard) from the index, or the one ``model.safetensors``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted(set(weight_map.values())), dict(weight_map)
    single = folder / "model.safetensors"
    if not single.is_file():
        raise InvalidModel(str(folder), "FP8 checkpoint without model.safetensors or model.safetensors.index.json")
    return ["model.safetensors"], {}


class _Reader:
    """Open shards lazily (memory-mapped by safetensors); a tensor is read only when asked for."""

    def __init__(self, folder: Path, weight_map: dict[str, str]) -> None:
        self.folder, self.weight_map, self._open = folder, weight_map, {}

    def file(self, shard: str):
        if shard not in self._open:
            from safetensors import safe_open

            self._open[shard] = safe_open(str(self.folder / shard), framework="pt")
        return self._open[shard]

    def tensor(self, name: str, default_shard: str):
        return self.file(self.weight_map.get(name, default_shard)).get_tensor(name)

    def has(self, name: str, default_shard: str) -> bool:
        shard = self.weight_map.get(name, default_shard)
        return (self.folder / shard).is_file() and name in self.file(shard).keys()


def _write_shard(
    path: Path,
    names: list[str],
    shapes: dict[str, list[int]],
    produce: Callable[[str], Any],
    out_dtype: Any,
) -> None:
    """A safetensors file written tensor by tensor: the header first (shapes are known), then each tensor's bytes
    as ``produce(name)`` returns it (float tensors in ``out_dtype``)."""
    import torch

    itemsize = torch.empty((), dtype=out_dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    code = _DTYPE_CODES[str(out_dtype).removeprefix("torch.")]
    for name in names:
        size = math.prod(shapes[name]) * itemsize
        header[name] = {"dtype": code, "shape": shapes[name], "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name in names:
            tensor = produce(name).to(out_dtype).contiguous()
            f.write(tensor.view(torch.uint8).numpy().tobytes())


@contextlib.contextmanager
def dequantized_copy(
    folder: str | Path,
    spec: Fp8Spec,
    dtype: str,
    *,
    scratch_parent: str | Path | None = None,
    say: Callable[[str], None] | None = None,
) -> Iterator[Path]:
    """Inside the block, a folder holding ``folder``'s checkpoint dequantized to ``dtype`` (float16, bfloat16 or
    float32): every FP8 weight times its block scales, every other float tensor cast.
    Made in a private temp folder under ``scratch_parent`` (default: the system's), removed on exit."""
    import torch

    folder = Path(folder)
    out_dtype = getattr(torch, dtype)
    shard_names, weight_map = _shards(folder)
    reader = _Reader(folder, weight_map)
    if scratch_parent is not None:
        Path(scratch_parent).mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".ortpa-dequantized.", dir=scratch_parent))
    fp8_types = {torch.float8_e4m3fn, torch.float8_e5m2}
    try:
        new_map: dict[str, str] = {}
        for i, shard in enumerate(shard_names):
            if say is not None:
                say(f"dequantizing {shard} ({i + 1}/{len(shard_names)}) to {dtype}")
            f = reader.file(shard)
            names = [n for n in f.keys() if not n.endswith(DROPPED_SUFFIXES)]
            shapes = {n: list(f.get_slice(n).get_shape()) for n in names}

            def produce(name: str, shard: str = shard):
                tensor = reader.tensor(name, shard)
                if tensor.dtype in fp8_types:
                    scale_name = name + SCALE_SUFFIX
                    if not reader.has(scale_name, shard):
                        raise InvalidModel(str(folder), f"FP8 tensor {name} has no {scale_name} beside it")
                    try:
                        return dequantize_blocks(tensor, reader.tensor(scale_name, shard), spec.block)
                    except ValueError as exc:
                        raise InvalidModel(str(folder), f"{name}: {exc}") from None
                return tensor

            ints = [n for n in names if f.get_slice(n).get_dtype() in ("I64", "I32", "I16", "I8", "U8", "BOOL")]
            if ints:  # no known FP8 checkpoint stores any; refused rather than cast to a float
                raise InvalidModel(str(folder), f"integer tensors in an FP8 checkpoint are not supported: {ints[:3]}")
            _write_shard(tmp / shard, names, shapes, produce, out_dtype)
            new_map.update(dict.fromkeys(names, shard))
        if weight_map:
            (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": new_map}))
        config = json.loads((folder / "config.json").read_text())
        config.pop("quantization_config", None)
        config["torch_dtype"] = config["dtype"] = dtype
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        for extra in ("generation_config.json",):
            if (folder / extra).is_file():
                shutil.copyfile(folder / extra, tmp / extra)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
