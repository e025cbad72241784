"""Which pipeline stage each weight of a checkpoint goes to, decided from its safetensors headers before any export.

``ortpa convert HF_DIR OUT --stages N`` streams every weight straight into its stage's own data file
(:mod:`ortpa.conversion.staged`), so the stages are chosen before the export, from what the checkpoint says without
reading a tensor: the headers' shapes and dtypes, and the names' layer numbers (``...layers.<i>.``, transformers'
naming for every decoder it loads). Layers are then grouped into ``N`` contiguous stages by weight bytes, as
:func:`ortpa.stages.partition.plan_split` groups a paged model's layers (a linear partition minimising the largest
stage): the embedding weighs on the first stage, the final norm and the output projection on the last, MoE layers
what their experts weigh. FP8 weights count at the two bytes a float16 export writes for them; their scales, which
the export folds in, count nothing.

The cut between stages is then made by :func:`~ortpa.stages.partition.plan_split` at these layers (its
``first_layers``), on the converted graph: a weight the graph reads elsewhere than its name says is copied to the
stage that reads it, never lost.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ortpa.errors import SplitRefused

__all__ = ["Placement", "place_layers"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_SCALE_SUFFIXES = ("_scale_inv", ".weight_scale_inv")
_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_FP8_EXPORTED = 2  # an FP8 weight is dequantized to float16 (or wider) by the export: two bytes at least


@dataclass(frozen=True)
class Placement:
    """Stages of a checkpoint's layers: stage ``s`` holds layers ``first_layers[s]`` up to the next stage's first."""

    layers: int
    first_layers: tuple[int, ...]  # starts with 0; one entry per stage
    stage_bytes: tuple[int, ...]  # the checkpoint's weight bytes (as exported) each stage holds

    @property
    def stages(self) -> int:
        return len(self.first_layers)

    def stage_of_layer(self, layer: int) -> int:
        return sum(1 for first in self.first_layers[1:] if layer >= first)

    def stage_of(self, name: str, transposed: bool = False) -> int:
        """The stage that reads parameter ``name``: its layer's; the embedding the first stage, except read
        transposed (a tied output projection); every other weight outside the layers (final norm, ``lm_head``)
        the last."""
        found = _LAYER.search(name)
        if found is not None and int(found.group(1)) < self.layers:
            return self.stage_of_layer(int(found.group(1)))
        if _is_embedding(name) and not transposed:
            return 0
        return self.stages - 1


def _is_embedding(name: str) -> bool:
    return "embed" in name and "lm_head" not in name


def _text_config(config: dict) -> dict:
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and "num_hidden_layers" in inner else config


def _headers(folder: Path) -> dict[str, dict]:
    """Every tensor's header entry (dtype, shape, data_offsets) over the folder's safetensors files."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SplitRefused(str(folder), "expected safetensors weights (*.safetensors) in the checkpoint, found none")
    out: dict[str, dict] = {}
    for path in files:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise SplitRefused(str(path), "expected a safetensors header, found a file under 8 bytes")
            (length,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(f.read(length))
            except ValueError as exc:
                raise SplitRefused(str(path), f"expected a JSON safetensors header: {exc}") from None
        out.update({k: v for k, v in header.items() if k != "__metadata__"})
    return out


def _exported_bytes(entry: dict) -> int:
    count = 1
    for d in entry.get("shape", []):
        count *= int(d)
    dtype = str(entry.get("dtype", ""))
    return count * (_FP8_EXPORTED if dtype.startswith("F8_") else _BYTES.get(dtype, 2))


def place_layers(folder: str | Path, stages: int) -> Placement:
    """The ``stages`` contiguous groups of the checkpoint's layers that minimise the largest group's weight bytes;
    :class:`~ortpa.errors.SplitRefused` when there are fewer layers than stages or no layer is named."""
    folder = Path(folder)
    try:
        config = _text_config(json.loads((folder / "config.json").read_text()))
        layers = int(config["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SplitRefused(str(folder), f"expected config.json with num_hidden_layers: {exc}") from None
    if not 1 <= stages <= layers:
        raise SplitRefused(str(folder), f"expected 1 to {layers} stages (one layer at least each), got {stages}")
    per_layer = [0] * layers
    first = last = 0  # bytes outside the layers: the embedding (first stage), the rest (last stage)
    for name, entry in _headers(folder).items():
        if name.endswith(_SCALE_SUFFIXES):
            continue
        nbytes = _exported_bytes(entry)
        found = _LAYER.search(name)
        if found is not None:
            if int(found.group(1)) < layers:  # layers past the count (multi-token prediction) are not loaded
                per_layer[int(found.group(1))] += nbytes
        elif _is_embedding(name):
            first += nbytes
        else:
            last += nbytes
    if not any(per_layer):
        raise SplitRefused(str(folder), "no weight of the checkpoint is named as a layer's (`...layers.<i>.`)")
    weights = list(per_layer)
    weights[0] += first
    weights[-1] += last
    starts = _linear_partition(weights, stages)
    bounds = [*starts, layers]
    return Placement(layers, tuple(starts), tuple(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))


def _linear_partition(weights: list[int], parts: int) -> list[int]:
    """The first index of each of ``parts`` contiguous groups of ``weights`` minimising the largest group's sum, and
    among those the sum of the groups' squares (the stages after a heavy first one still share their layers)."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = (float("inf"), float("inf"))
    best: list[list[tuple[float, float]]] = [[inf] * (n + 1) for _ in range(parts + 1)]
    back = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = (0, 0)
    for s in range(1, parts + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                seg = prefix[j] - prefix[i]
                cost = (max(best[s - 1][i][0], seg), best[s - 1][i][1] + seg * seg)
                if cost < best[s][j]:
                    best[s][j], back[s][j] = cost, i
    starts, j = [], n
    for s in range(parts, 0, -1):
        j = back[s][j]
        starts.append(j)
    return sorted(starts)
