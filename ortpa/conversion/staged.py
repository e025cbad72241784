"""A Hugging Face checkpoint -> a verified stage folder, without the model ever existing as one file.

``ortpa convert HF_DIR OUT --stages N`` (:func:`convert_to_stages`): the stages are chosen first, from the
checkpoint's safetensors headers (:func:`ortpa.stages.place.place_layers`: layers grouped by weight bytes); the
export then streams each weight straight into the data file of the stage that reads it (``stage_<i>.onnx.data``,
:func:`ortpa.export.hf.export_hf`'s ``layout``), in a staging folder beside the output. The dense graph and the paged
graph the rewrite makes from it are written as graphs only, their weights referenced in the stage files where they
lie (:func:`ortpa.rewriter.model_store.write_in_place`; a weight the rewrite computes goes to a side file). The paged
graph is checked and verified against the dense one as ``convert`` does, cut at the chosen layers
(:func:`ortpa.stages.partition.plan_split`), each stage written referencing its placed weights (weights elsewhere
copied in), the chain proved against the unsplit paged graph as ``ortpa split`` does, and the stage data files
compacted (:func:`ortpa.stages.compact.compact_stages`: weights the rewrite replaced dropped). The dense and paged
graphs and the side files are then removed, the tokenizer and config files copied, and the folder moved into place
with one rename: complete or absent.

Memory: the export's (the largest tensor plus a constant), then what the checks and proofs run. Disk: the stage files,
plus the rewrite's computed weights and one stage file while it is compacted.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ortpa.conversion.options import ConvertOptions
from ortpa.conversion.orchestrator import _options, _verify, export_dense
from ortpa.errors import ConversionError
from ortpa.extras import require_extra
from ortpa.model.position_bias import refuse_position_bias
from ortpa.model.ref import NoOnnxFile, companion_files, copy_companion_files, locate_model
from ortpa.progress import Progress, Stage, report
from ortpa.rewriter import model_store, pipeline
from ortpa.runtime.stage_folder import StageManifest
from ortpa.stages.compact import compact_stages
from ortpa.stages.partition import plan_split
from ortpa.stages.place import Placement, place_layers
from ortpa.stages.prove import SplitProof, prove_split
from ortpa.stages.write import write_stages

if TYPE_CHECKING:
    from ortpa.parity.verify import Verification

__all__ = ["StagedConversion", "convert_to_stages"]

_DENSE = "dense.onnx"
_PAGED = "model.onnx"  # the unsplit paged graph's name: the manifest's `source`


@dataclass(frozen=True)
class StagedConversion:
    """What :func:`convert_to_stages` published."""

    folder: Path
    manifest: StageManifest
    placement: Placement
    verification: Verification | None  # the paged graph against the dense export; None: verify=False
    proof: SplitProof | None  # the chain of stages against the paged graph; None: verify=False
    copied: tuple[str, ...]
    compacted_bytes: int  # weights the rewrite replaced, dropped from the stage files


def convert_to_stages(
    model: str | os.PathLike,
    out: str | os.PathLike,
    stages: int,
    options: ConvertOptions | None = None,
    *,
    progress: Progress | None = None,
    **fields: Any,
) -> StagedConversion:
    """Convert the Hugging Face checkpoint folder ``model`` into a stage folder of ``stages`` pipeline stages at
    ``out`` (a new or empty folder), writing no unsplit model file: see the module docstring. ``options`` as for
    :func:`~ortpa.conversion.convert_file`; ``portable`` and ``keep_dense`` are refused (a stage folder runs ortpa's
    runtime, and the dense export is never one file)."""
    opts = _options(options, fields)
    opts.check()
    if opts.portable:
        raise ConversionError(
            "--stages with --portable: expected one or the other; a stage folder runs on ortpa's runtime (Ray "
            "stages), which has PagedAttention on every provider; --portable is for a single file run elsewhere"
        )
    if opts.keep_dense is not None:
        raise ConversionError(
            "--stages with --keep-dense: expected one or the other; stages written from a checkpoint never have "
            "a dense model as one file (its weights go straight into the stages' files)"
        )
    folder = _checkpoint(model, opts)
    target = Path(os.path.abspath(out))
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ConversionError(f"cannot write {os.fspath(out)}: expected a new or empty folder, found {target}")
    require_extra("export", f"{folder} is a Hugging Face checkpoint: exporting it")
    from ortpa.export.checkpoint_dtype import default_export_dtype, refuse_cpu_bfloat16, stored_dtype

    refuse_position_bias(folder)  # before any export work
    refuse_cpu_bfloat16(str(folder), default_export_dtype(stored_dtype(folder), opts.export.dtype), opts.providers)
    placement = place_layers(folder, stages)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    mask = os.umask(0o022)  # the folder becomes the output: a folder's usual mode, not mkdtemp's 0700
    os.umask(mask)
    os.chmod(staging, 0o777 & ~mask)
    try:
        result = _build(folder, staging, placement, opts, progress)
        companions = [c for c in companion_files(folder) if c[0] != "genai_config.json"]
        copied = tuple(copy_companion_files(companions, staging))
        report(progress, Stage.DONE, f"moving {target.name} into place")
        if target.exists():
            target.rmdir()
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    manifest, verification, proof, dropped = result
    return StagedConversion(
        target,
        StageManifest(**{**manifest.__dict__, "folder": target}),
        placement,
        verification,
        proof,
        copied,
        dropped,
    )


def _checkpoint(model: Any, opts: ConvertOptions) -> Path:
    """The checkpoint folder ``model`` names; an ONNX model is refused (``ortpa split`` cuts a converted one)."""
    try:
        ref = locate_model(model, opts.revision)
    except NoOnnxFile as exc:
        if (exc.folder / "config.json").is_file():
            return exc.folder
        raise
    raise ConversionError(
        f"stages straight from a checkpoint: expected a Hugging Face checkpoint folder, found the ONNX model "
        f"{ref.path}; convert it, then `ortpa split` the converted model"
    )


def _build(
    folder: Path, staging: Path, placement: Placement, opts: ConvertOptions, progress: Progress | None
) -> tuple[StageManifest, Verification | None, SplitProof | None, int]:
    """Everything in ``staging``; returns the manifest, the verification, the split's proof, the bytes compacted."""
    dense, paged = staging / _DENSE, staging / _PAGED

    def layout(name: str, transposed: bool) -> Path:
        return staging / f"stage_{placement.stage_of(name, transposed)}.onnx.data"

    sizes = ", ".join(f"{b / 1e6:.0f}" for b in placement.stage_bytes)
    report(
        progress,
        Stage.EXPORT,
        f"exporting {folder} into {placement.stages} stages (first layers {list(placement.first_layers)}; {sizes} MB)",
    )
    export_dense(
        folder, dense, opts.export, random_weights=False, progress=progress, layout=layout, node_metadata=False
    )
    report(progress, Stage.LOAD, "loading")
    irm = model_store.load_ir(dense)
    pipeline.rewrite(irm, opts.rewrite, progress=progress, spill=model_store.Spill(staging), source=dense)
    model_store.write_in_place(irm, paged, progress)
    del irm
    header = model_store.check_written(paged, opts.providers, progress)
    verification = _verify(dense, paged, opts, progress) if opts.verify else None
    report(progress, Stage.DEPLOY, f"writing {placement.stages} stages")
    plan = plan_split(header, placement.stages, label=str(folder), first_layers=placement.first_layers)
    manifest = write_stages(header, staging, plan, staging, _PAGED, placed=True)
    manifest = StageManifest(**{**manifest.__dict__, "folder": staging})
    proof = prove_split(paged, header, manifest) if opts.verify else None
    for name in (_DENSE, f"{_DENSE}.data", _PAGED, f"{_PAGED}.data", model_store.Spill(staging).path.name):
        (staging / name).unlink(missing_ok=True)
    manifest, dropped = compact_stages(manifest)
    return manifest, verification, proof, dropped
