"""The one conversion path: a dense model (or a Hugging Face checkpoint) -> a verified paged deployment folder.

:func:`convert_file` locates the model once, then, in a staging folder next to the output
(:mod:`ortpa.conversion.staging`): exports a checkpoint first (:func:`export_dense`), rewrites the graph
(:func:`ortpa.rewriter.pipeline.rewrite`, graph -> graph), writes it (weights streamed), checks it (onnx.checker,
every node validated, ONNX Runtime opening it on each provider), verifies it against the original (the one
narrow call :func:`_verify`), stamps the verification's figures, lowers it with ``portable``, writes
``genai_config.json`` and copies the tokenizer and config files; then publishes it with one move. Each package is
visited once, in that order, and nothing is reopened or rewritten after the move.

:func:`convert` is the in-memory conversion (``ortpa.convert``): the same rewrite and checks, the ModelProto
returned, nothing written, no verification, no deployment files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import onnx_ir as ir

from ortpa.conversion.options import ConvertOptions, ExportOptions
from ortpa.conversion.staging import Staging, staging
from ortpa.deploy.genai_config import build_genai_config
from ortpa.deploy.portable_file import PortableInfo, lower_graph
from ortpa.errors import ConversionError, OrtpaError, Unavailable
from ortpa.extras import require_extra
from ortpa.model.position_bias import refuse_position_bias
from ortpa.model.ref import ModelRef, NoOnnxFile, companion_files, copy_companion_files, locate_model
from ortpa.progress import BytesWritten, Progress, Stage, report, reporter
from ortpa.rewriter import model_store, pipeline

if TYPE_CHECKING:
    from ortpa.export.hf import ExportInfo
    from ortpa.parity.verify import Verification

__all__ = ["Conversion", "convert", "convert_file", "export_dense"]

GENAI_CONFIG = "genai_config.json"


@dataclass(frozen=True)
class Conversion:
    """What :func:`convert_file` published."""

    model: Path  # the paged model (its weights in <model>.data when external)
    genai_config: Path
    source: Path  # the dense model converted (for a checkpoint: its export, gone unless kept)
    paged_attention_nodes: int  # lowered to standard ONNX ops when `portable` is set
    portable: PortableInfo | None
    verification: Verification | None  # None: verify=False
    copied: tuple[str, ...]  # tokenizer and config files copied beside the model
    eos_token_id: bool  # whether genai_config.json names one (genai otherwise stops at token id 0)
    metadata_folder: Path | None  # where the token ids and tokenizer came from (the input's folder); None: nowhere
    kv_cache_dtype: str | None = None  # the caches' element type (ortpa.kv_cache_dtype), and why it is that
    kv_cache_dtype_reason: str | None = None
    # MLA: the prefill form the model carries ("expanded" / "absorbed"), and why not the expanded one; None: not MLA
    mla_prefill: str | None = None
    mla_prefill_reason: str | None = None


def convert_file(
    model: str | os.PathLike | ModelRef,
    out_path: str | os.PathLike,
    options: ConvertOptions | None = None,
    *,
    progress: Progress | None = None,
    **fields: Any,
) -> Conversion:
    """Convert ``model`` into a verified deployment at ``out_path``: the paged model (and ``<out>.data``),
    ``genai_config.json`` and the source folder's tokenizer and config files, complete or absent.

    ``model``: a dense ONNX file, a model folder, a Hugging Face repo id in the local cache (offline), or a Hugging
    Face checkpoint folder (config.json and weights, no ONNX file: exported first, needs the ``export`` extra).
    ``options`` (or its fields as keywords, :meth:`ConvertOptions.of`) say what to make and check; ``progress``
    receives typed events (:mod:`ortpa.progress`). On a verification mismatch nothing is written and the
    :class:`~ortpa.errors.ConversionError` names the first diverging layer. The input is never modified.
    """
    opts = _options(options, fields)
    opts.check()  # bad option combinations: refused before any work
    out = Path(out_path)
    with contextlib.ExitStack() as stack:
        stage = stack.enter_context(staging(out))
        ref = _locate(model, opts, stage, stack, progress)
        if Path(ref.path).resolve() == out.resolve():
            raise ConversionError("refusing to overwrite the input model", [("out_path", os.fspath(out_path))])
        companions = [c for c in companion_files(ref.folder) if c[0] != GENAI_CONFIG] if ref.folder else []
        report(progress, Stage.LOAD, "loading")
        irm = model_store.load_ir(_source(model, ref))
        pipeline.rewrite(irm, opts.rewrite, progress=progress, spill=model_store.Spill(stage.scratch), source=ref.path)
        try:
            final_data = out.parent / f"{out.name}.data"
            model_store.write(irm, stage.model, progress, scratch=stage.scratch, final_data=final_data)
        except OSError as exc:
            raise ConversionError(f"cannot write {os.fspath(out_path)}: {exc.strerror or exc}") from exc
        del irm  # the rewritten graph is on disk now; everything below reads the staged file
        header = model_store.check_written(stage.model, opts.providers, progress)
        verification = _verify(ref.path, stage.model, opts, progress) if opts.verify else None
        conversion = _deploy(header, stage, ref, opts, verification, companions, progress)
        report(progress, Stage.DONE, f"moving {out.name} into place")
        stage.commit()
    return conversion


def _options(options: ConvertOptions | None, fields: dict) -> ConvertOptions:
    if options is not None and fields:
        raise TypeError("give the conversion options as a ConvertOptions or as keywords, not both")
    return options if options is not None else ConvertOptions.of(**fields)


def _source(model: Any, ref: ModelRef) -> Path | str | os.PathLike:
    """A plain file keeps the caller's spelling, which the loader's messages name."""
    if isinstance(model, (str, os.PathLike)) and Path(ref.path) == Path(model):
        return model
    return ref.path


def _locate(
    model: Any, opts: ConvertOptions, stage: Staging, stack: contextlib.ExitStack, progress: Progress | None
) -> ModelRef:
    """The model, located once; a Hugging Face checkpoint folder exported to dense ONNX first."""
    try:
        ref = locate_model(model, opts.revision)
    except NoOnnxFile as exc:
        if not (exc.folder / "config.json").is_file():
            raise
        refuse_position_bias(exc.folder)  # a model that cannot be converted is refused before any export work
        try:
            return _export_checkpoint(exc.folder, opts, stage, stack, progress)
        except Unavailable:  # a missing extra: said as such, not as a refused model
            raise
        except OrtpaError as err:  # one line: the folder was no ONNX model, and exporting it failed too
            raise ConversionError(f"{exc}; exporting it as a Hugging Face checkpoint failed: {err}") from err
    if opts.keep_dense is not None:
        raise ConversionError(
            "keep_dense (--keep-dense): expected a Hugging Face checkpoint folder as the input (the dense export "
            f"to keep), found the ONNX model {ref.path}"
        )
    return ref


def _export_checkpoint(
    folder: Path, opts: ConvertOptions, stage: Staging, stack: contextlib.ExitStack, progress: Progress | None
) -> ModelRef:
    require_extra("export", f"{folder} is a Hugging Face checkpoint: exporting it")
    from ortpa.export.checkpoint_dtype import default_export_dtype, refuse_cpu_bfloat16, stored_dtype

    refuse_cpu_bfloat16(str(folder), default_export_dtype(stored_dtype(folder), opts.export.dtype), opts.providers)
    if opts.keep_dense is not None:
        dense_dir = Path(opts.keep_dense)
        dense_dir.mkdir(parents=True, exist_ok=True)
    else:  # beside the staging folder (same disk), removed when the conversion ends
        dense_dir = Path(tempfile.mkdtemp(prefix=".ortpa-dense.", dir=stage.folder.parent))
        stack.callback(shutil.rmtree, dense_dir, True)
    dense = dense_dir / "model.onnx"
    report(progress, Stage.EXPORT, f"exporting {folder} -> {dense}")
    # the dense model is rewritten at once: torch's per-node stack traces (most of its graph's bytes) are dropped
    export_dense(folder, dense, opts.export, random_weights=False, progress=progress, node_metadata=False)
    return ModelRef(dense, folder)


def export_dense(
    model: Any,
    out_path: str | os.PathLike,
    options: ExportOptions | None = None,
    *,
    random_weights: bool = False,
    progress: Progress | None = None,
    layout: Callable[[str, bool], Path | None] | None = None,
    node_metadata: bool = True,
) -> ExportInfo:
    """A Hugging Face model (local folder, or a config with ``random_weights``) -> the dense ONNX model at
    ``out_path`` (``ortpa export``, and the first step of converting a checkpoint). Needs the ``export`` extra.
    ``layout``: the data file each checkpoint parameter is streamed into; ``node_metadata``: keep torch's per-node
    debugging metadata (:func:`ortpa.export.hf.export_hf`)."""
    require_extra("export", "exporting a Hugging Face model")
    from ortpa.export.hf import export_hf

    o = options or ExportOptions()
    return export_hf(
        model,
        out_path,
        random_weights=random_weights,
        opset=o.opset,
        attn_implementation=o.attn_implementation,
        experts=o.experts,
        dtype=o.dtype,
        external_data=o.external_data,
        progress=reporter(progress, Stage.EXPORT),
        verbose=o.verbose,
        written=None if progress is None else lambda done, total: progress(BytesWritten(done, total, Stage.EXPORT)),
        layout=layout,
        repeat_layers=False if o.trace_every_layer else None,
        node_metadata=node_metadata,
    )


def _verify(original: Path, converted: Path, opts: ConvertOptions, progress: Progress | None) -> Verification:
    """The converted model against its original: the one call into :mod:`ortpa.parity.verify`."""
    from ortpa.parity.verify import verify_conversion

    return verify_conversion(original, converted, steps=opts.verify_steps, progress=reporter(progress, Stage.VERIFY))


def _deploy(
    header: onnx.ModelProto,
    stage: Staging,
    ref: ModelRef,
    opts: ConvertOptions,
    verification: Verification | None,
    companions: list[tuple[str, str]],
    progress: Progress | None,
) -> Conversion:
    """The staged model's graph finished in memory and written once (verification figures, ``portable``
    lowering), then ``genai_config.json`` and the companion files beside it, all in the staging folder."""
    nodes = sum(1 for n in header.graph.node if n.op_type == "PagedAttention")
    meta = {p.key: p.value for p in header.metadata_props}
    form = meta.get("ortpa.mla_prefill")
    prefill, _, prefill_reason = form.partition(": ") if form is not None else (None, "", "")
    changed = False
    if verification is not None:
        _stamp(header, verification.metadata())
        changed = True
    portable = None
    if opts.portable:
        report(progress, Stage.LOWER, "lowering PagedAttention to standard ONNX ops (--portable)")
        portable = lower_graph(header, stage.out.name, if_free=opts.if_free)
        changed = True
    if changed:  # the graph only: the weights stay in the staged .data (an inline model is small)
        onnx.save(header, str(stage.model))
    report(progress, Stage.DEPLOY, f"writing {GENAI_CONFIG}")
    portable_meta = dataclasses.asdict(portable) if portable is not None else None
    config = build_genai_config(
        header,
        stage.out.name,
        portable=opts.portable,
        source_folder=ref.folder,
        options=opts.genai,
        portable_meta=portable_meta,
    )
    (stage.folder / GENAI_CONFIG).write_text(json.dumps(config, indent=4) + "\n", encoding="utf-8")
    copied = tuple(copy_companion_files(companions, stage.folder))
    return Conversion(
        model=stage.out,
        genai_config=stage.out.parent / GENAI_CONFIG,
        source=Path(ref.path),
        paged_attention_nodes=portable.nodes if portable is not None else nodes,
        portable=portable,
        verification=verification,
        copied=copied,
        eos_token_id="eos_token_id" in config.get("model", {}),
        metadata_folder=ref.folder,
        kv_cache_dtype=meta.get("ortpa.kv_cache_dtype"),
        kv_cache_dtype_reason=meta.get("ortpa.kv_cache_dtype_reason"),
        mla_prefill=prefill,
        mla_prefill_reason=prefill_reason or None,
    )


def _stamp(proto: onnx.ModelProto, entries: dict[str, str]) -> None:
    """Add (or replace) metadata entries of ``proto``."""
    kept = [(p.key, p.value) for p in proto.metadata_props if p.key not in entries]
    del proto.metadata_props[:]
    for key, value in [*kept, *entries.items()]:
        proto.metadata_props.add(key=key, value=value)


def convert(
    model: onnx.ModelProto | ir.Model | str | os.PathLike,
    options: ConvertOptions | None = None,
    *,
    progress: Progress | None = None,
    **fields: Any,
) -> onnx.ModelProto:
    """``ortpa.convert``: the conversion in memory. The same rewrite and checks as :func:`convert_file`, the
    checked ModelProto returned; nothing is written, the model is not verified against its original and no
    deployment files are made (use :func:`convert_file` for that). Only the rewrite's options, ``providers`` and
    ``revision`` apply."""
    if "out_path" in fields or (isinstance(options, (str, os.PathLike))):
        raise TypeError(
            "ortpa.convert returns the converted model in memory and writes nothing; to write a verified "
            "deployment use ortpa.convert_file(model, out_path, ...)"
        )
    opts = _options(options, fields)
    return pipeline.convert(model, opts.rewrite, progress=progress, providers=opts.providers, revision=opts.revision)
