"""A stage folder: a paged model split into pipeline stages (``ortpa split``), as its manifest describes it.

``stages.json`` names, per stage, its layer range, its ONNX file and that file's external data (each file's size
and SHA-256), the token values it receives from the previous stage and sends to the next (names, element types,
shapes: the *boundary*), and its own KV cache inputs and outputs. Every stage takes the same shared inputs
(``input_ids``, the step's index tensors); one block table serves every stage, each stage allocating cache for
its own layers only.

:func:`read_stage_folder` refuses a folder that is incomplete or disagrees with its manifest, naming the file:
sizes are checked always, SHA-256 digests where asked (:func:`check_stage_files`, which each stage process
runs on its own files before opening them).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ortpa.errors import InvalidModel

__all__ = [
    "MANIFEST",
    "MANIFEST_VERSION",
    "BoundaryTensor",
    "StageFile",
    "StageManifest",
    "StageSpec",
    "check_stage_files",
    "is_stage_folder",
    "read_stage_folder",
    "sha256_file",
]

MANIFEST = "stages.json"
MANIFEST_VERSION = 1
_CHUNK = 16 << 20


@dataclass(frozen=True)
class BoundaryTensor:
    """A token value crossing a cut: its name in both stages, element type and shape (symbolic dims by name)."""

    name: str
    dtype: str
    shape: tuple[int | str, ...]


@dataclass(frozen=True)
class StageFile:
    name: str  # relative to the folder
    bytes: int
    sha256: str


@dataclass(frozen=True)
class StageSpec:
    """One stage: layers ``[first_layer, stop_layer)``, its model file (first of ``files``) and its interface."""

    index: int
    first_layer: int
    stop_layer: int
    files: tuple[StageFile, ...]
    boundary_in: tuple[BoundaryTensor, ...]
    boundary_out: tuple[BoundaryTensor, ...]
    cache_inputs: tuple[str, ...]
    cache_outputs: tuple[str, ...]
    weight_bytes: int  # initializer bytes of this stage (small index tables repeated in each stage included)

    @property
    def model(self) -> str:
        return self.files[0].name


@dataclass(frozen=True)
class StageManifest:
    """What ``stages.json`` holds. ``folder`` is where it was read (not stored)."""

    version: int
    source: str  # the unsplit model's file name
    source_weight_bytes: int
    layers: int
    shared_inputs: tuple[str, ...]
    stages: tuple[StageSpec, ...]
    folder: Path | None = None

    def stage_path(self, index: int) -> Path:
        if self.folder is None:
            raise ValueError("a manifest not read from a folder has no paths")
        return self.folder / self.stages[index].model

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("folder")
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> StageManifest:
        try:
            data = json.loads(text)
            if data.get("version") != MANIFEST_VERSION:
                raise InvalidModel(where, f"expected manifest version {MANIFEST_VERSION}, found {data.get('version')}")
            stages = tuple(
                StageSpec(
                    index=int(s["index"]),
                    first_layer=int(s["first_layer"]),
                    stop_layer=int(s["stop_layer"]),
                    files=tuple(StageFile(str(f["name"]), int(f["bytes"]), str(f["sha256"])) for f in s["files"]),
                    boundary_in=tuple(_tensor(t) for t in s["boundary_in"]),
                    boundary_out=tuple(_tensor(t) for t in s["boundary_out"]),
                    cache_inputs=tuple(map(str, s["cache_inputs"])),
                    cache_outputs=tuple(map(str, s["cache_outputs"])),
                    weight_bytes=int(s["weight_bytes"]),
                )
                for s in data["stages"]
            )
            return cls(
                version=int(data["version"]),
                source=str(data["source"]),
                source_weight_bytes=int(data["source_weight_bytes"]),
                layers=int(data["layers"]),
                shared_inputs=tuple(map(str, data["shared_inputs"])),
                stages=stages,
            )
        except InvalidModel:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidModel(where, f"not a stage manifest ({type(exc).__name__}: {exc})") from None


def _tensor(t: dict) -> BoundaryTensor:
    return BoundaryTensor(str(t["name"]), str(t["dtype"]), tuple(t["shape"]))


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def is_stage_folder(path: str | os.PathLike) -> bool:
    return Path(path).is_dir() and (Path(path) / MANIFEST).is_file()


def check_stage_files(folder: Path, spec: StageSpec, *, hashes: bool) -> None:
    """:class:`InvalidModel` naming the first file of ``spec`` that is missing or differs from the manifest."""
    for f in spec.files:
        path = folder / f.name
        if Path(f.name).is_absolute() or ".." in Path(f.name).parts:
            raise InvalidModel(str(folder / MANIFEST), f"stage {spec.index} names {f.name!r}, outside the folder")
        if not path.is_file():
            raise InvalidModel(str(path), f"missing: the manifest lists it for stage {spec.index}")
        size = path.stat().st_size
        if size != f.bytes:
            raise InvalidModel(str(path), f"{size} bytes, the manifest says {f.bytes} (stage {spec.index})")
        if hashes and sha256_file(path) != f.sha256:
            raise InvalidModel(str(path), f"SHA-256 differs from the manifest's (stage {spec.index}): file changed")


def read_stage_folder(folder: str | os.PathLike, *, hashes: bool = False) -> StageManifest:
    """The manifest of a stage folder, every file checked (sizes; digests too with ``hashes``)."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        raise InvalidModel(str(folder), f"not a stage folder: no {MANIFEST}")
    manifest = StageManifest.from_json(path.read_text(), str(path))
    if not manifest.stages or [s.index for s in manifest.stages] != list(range(len(manifest.stages))):
        raise InvalidModel(str(path), "expected stages numbered 0, 1, ... in order")
    layers = [(s.first_layer, s.stop_layer) for s in manifest.stages]
    if (
        layers[0][0] != 0
        or layers[-1][1] != manifest.layers
        or any(a[1] != b[0] for a, b in itertools.pairwise(layers))
    ):
        raise InvalidModel(str(path), f"layer ranges {layers} do not tile layers 0..{manifest.layers}")
    for a, b in itertools.pairwise(manifest.stages):
        if a.boundary_out != b.boundary_in:
            raise InvalidModel(
                str(path), f"stage {a.index} sends {a.boundary_out}, stage {b.index} expects {b.boundary_in}"
            )
    for spec in manifest.stages:
        check_stage_files(folder, spec, hashes=hashes)
    return StageManifest(**{**manifest.__dict__, "folder": folder})
