"""Pipeline stages: a paged model split by layers (``ortpa split``, ``ortpa convert --stages N``).

:func:`split_model` plans the cut by dataflow (:mod:`ortpa.stages.partition`), writes one ONNX file per stage with
its own weights and the manifest into a staging folder beside the output (:mod:`ortpa.stages.write`), proves the
chain of stages against the unsplit model (:mod:`ortpa.stages.prove`), and only then moves the folder into place:
the output is complete or absent. Running a stage folder: :mod:`ortpa.runtime.pipeline`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ortpa.errors import SplitRefused
from ortpa.model.file import read_model
from ortpa.model.ref import companion_files, copy_companion_files, resolve_any
from ortpa.runtime.stage_folder import StageManifest
from ortpa.stages.partition import plan_split
from ortpa.stages.prove import SplitProof, prove_split
from ortpa.stages.write import write_stages

__all__ = ["SplitResult", "split_model"]


@dataclass(frozen=True)
class SplitResult:
    folder: Path
    manifest: StageManifest
    proof: SplitProof | None


def split_model(model: str | os.PathLike, out: str | os.PathLike, stages: int, *, verify: bool = True) -> SplitResult:
    """Split the paged model at ``model`` into ``stages`` stages in the new folder ``out``; see the module doc."""
    source = Path(resolve_any(model))
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SplitRefused(str(source), f"{out} exists and is not an empty folder")
    loaded = read_model(source, load_external_data=False)
    header = loaded.proto
    plan = plan_split(header, stages, label=str(source))
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        manifest = write_stages(header, loaded.base_dir, plan, staging, source.name)
        # the tokenizer and configs beside the model; not genai_config.json, which describes the unsplit file
        companions = [(n, p) for n, p in companion_files(source.parent) if n != "genai_config.json"]
        copy_companion_files(companions, staging)
        proof = prove_split(source, header, manifest) if verify else None
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return SplitResult(out, StageManifest(**{**manifest.__dict__, "folder": out}), proof)
