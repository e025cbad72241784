"""Conversion that writes: the rewriter's :func:`ortpa.rewriter.pipeline.convert` into a file, verified first.

:func:`convert_file` streams the converted model into a temp folder next to ``out_path``, checks it there, runs
:func:`ortpa.parity.verify.verify_conversion` on it against the original (unless ``verify=False``), stamps the
verification's figures into the model's metadata, and only then moves it into place: a model that does not match
its original is never written. :func:`convert` is the public ``ortpa.convert``: in memory as the rewriter's, and
through :func:`convert_file` when given ``out_path``.

This sits above the rewriter (it calls verification, which runs the runtime), so the rewriter never imports it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from ortpa.errors import ConversionError
from ortpa.model.ref import ModelRef, companion_files, copy_companion_files, locate_model
from ortpa.parity.verify import DEFAULT_STEPS, Verification, verify_conversion
from ortpa.rewriter import pipeline

__all__ = ["convert", "convert_file"]


def convert_file(
    in_path: str | os.PathLike | ModelRef,
    out_path: str | os.PathLike,
    revision: str | None = None,
    *,
    verify: bool = True,
    verify_steps: int = DEFAULT_STEPS,
    on_verified: Callable[[Verification], None] | None = None,
    **options: Any,
) -> onnx.ModelProto:
    """:func:`ortpa.convert` a model file into ``out_path``: streamed, checked from the written files, verified
    against the original, then moved into place (the output and its ``.data`` are complete or absent; the input
    is never modified).

    Verification (``verify=True``, the default; :mod:`ortpa.parity.verify`) runs the original alone and the
    converted model batched on a few seeded prompts for ``verify_steps`` greedy steps; on a mismatch nothing is
    written and the :class:`~ortpa.errors.ConversionError` names the first diverging layer. Its figures go into the
    model's metadata (``ortpa.verify.*``) and to ``on_verified``. One rule for every model (:mod:`ortpa.parity.rule`):
    structure on a float32 twin of the conversion, precision by statistics bounded by the deployed dtype; no
    family or size enters it. A model ONNX Runtime's
    CPU kernels cannot run (``dtype="bfloat16"``) cannot be verified here and is refused unless ``verify=False``.
    ``verify=False`` skips it: for a model too large for the machine's memory to run (once the converted model,
    once the original: one after the other, never both at once).

    ``in_path`` may be a folder or a Hugging Face repo id in the local cache (:mod:`ortpa.model.ref`); the
    tokenizer and config files of such a model's folder are then copied beside ``out_path``, as regular files.

    Returns the written model: the whole model when it is inline; when its weights are in ``<out>.data``,
    the graph with external references relative to the output's folder (``onnx.load(out_path)`` or
    ``onnx.load_external_data_for_model(model, out_dir)`` read them in; sessions take ``out_path`` itself).
    """
    ref = locate_model(in_path, revision)
    # a plain file keeps the caller's spelling, which the loader's messages name
    source = in_path if isinstance(in_path, (str, os.PathLike)) and ref.path == Path(in_path) else ref.path
    companions = companion_files(ref.folder) if ref.folder is not None else []  # refused before the work
    progress = options.get("progress")
    before_move = None
    if verify:

        def before_move(tmp_model: Path) -> dict[str, str]:
            result = verify_conversion(ref.path, tmp_model, steps=verify_steps, progress=progress)
            if on_verified is not None:
                on_verified(result)
            return result.metadata()

    try:
        written = pipeline.convert(source, out_path, before_move=before_move, **options)
    except OSError as exc:
        raise ConversionError(f"cannot write {os.fspath(out_path)}: {exc.strerror or exc}") from exc
    copy_companion_files(companions, Path(out_path).parent)
    return written


def convert(
    model: onnx.ModelProto | ir.Model | str | os.PathLike,
    out_path: str | os.PathLike | None = None,
    **options: Any,
) -> onnx.ModelProto:
    """Convert a dense model (see :func:`ortpa.rewriter.pipeline.convert` for the options): in memory, or with
    ``out_path`` written by :func:`convert_file` (verified against the original unless ``verify=False``)."""
    if out_path is None:
        return pipeline.convert(model, **options)
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            "convert(model, out_path): a written conversion is verified against the original's file, "
            f"so model must be a path; got {type(model).__name__} (save it first, or omit out_path)"
        )
    return convert_file(model, out_path, **options)
