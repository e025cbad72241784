"""A converted model as a deployment: the paged file (native or ``--portable``) and its ``genai_config.json``.

:func:`convert_deployment` is the conversion (:func:`ortpa.parity.convert_file.convert_file`, which validates
the PagedAttention nodes, verifies the model against its original and writes the file) followed by one separate
post-conversion step,
:func:`finish_deployment`: with ``portable=True`` lower every node to standard ONNX ops in place
(:mod:`ortpa.deploy.portable_file`), then write ``genai_config.json`` beside the model
(:mod:`ortpa.deploy.genai_config`). A failure in that step removes what the conversion wrote: the output is a
whole deployment or absent.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import onnx

from ortpa.deploy.genai_config import GenaiOptions, write_genai_config
from ortpa.deploy.portable_file import PortableInfo, lower_file
from ortpa.errors import ConversionError
from ortpa.model.ref import ModelRef, locate_model

__all__ = ["Deployment", "check_portable_options", "convert_deployment", "convert_file", "finish_deployment"]


@dataclass(frozen=True)
class Deployment:
    """What :func:`finish_deployment` wrote next to the converted model."""

    model: Path
    genai_config: Path
    portable: PortableInfo | None  # None: the native op (CUDA / WebGPU)


def check_portable_options(*, kv_cache_dtype: str | None = None, **_: object) -> None:
    """Options ``portable=True`` cannot honour, refused before any work (one line)."""
    if kv_cache_dtype == "float8e4m3fn":
        raise ConversionError(
            "--portable cannot honour --kv-cache-dtype float8e4m3fn: ONNX Gather/ScatterND have no float8 form; "
            "use float16, bfloat16 or int8"
        )


def finish_deployment(
    out_path: str | os.PathLike,
    *,
    portable: bool = False,
    source_folder: str | os.PathLike | None = None,
    genai: GenaiOptions | None = None,
) -> Deployment:
    """The post-conversion step on a written, validated model file (see the module docstring)."""
    out = Path(out_path)
    (genai or GenaiOptions()).check()
    info = lower_file(out) if portable else None
    meta = dataclasses.asdict(info) if info is not None else None
    folder = Path(source_folder) if source_folder is not None else None
    config = write_genai_config(out, portable=portable, source_folder=folder, options=genai, portable_meta=meta)
    return Deployment(out, config, info)


def _remove_output(out: Path) -> None:
    proto = None
    try:
        proto = onnx.load(str(out), load_external_data=False)
    except Exception:
        pass
    locations = set()
    if proto is not None:
        for t in proto.graph.initializer:
            for kv in t.external_data:
                if kv.key == "location":
                    locations.add(kv.value)
    for name in locations:
        (out.parent / name).unlink(missing_ok=True)
    out.unlink(missing_ok=True)


def convert_deployment(
    in_path: str | os.PathLike | ModelRef,
    out_path: str | os.PathLike,
    *,
    portable: bool = False,
    genai: GenaiOptions | None = None,
    revision: str | None = None,
    **options,
) -> tuple[onnx.ModelProto, Deployment]:
    """Convert ``in_path`` to ``out_path`` and finish it as a deployment: (the conversion's result, what was
    written). ``options`` are :func:`ortpa.convert`'s."""
    from ortpa.parity.convert_file import convert_file  # verified against the original unless verify=False

    if portable:
        check_portable_options(**options)
    (genai or GenaiOptions()).check()
    ref = locate_model(in_path, revision)
    result = convert_file(ref if isinstance(in_path, ModelRef) else in_path, out_path, revision=revision, **options)
    try:
        deployment = finish_deployment(out_path, portable=portable, source_folder=ref.folder, genai=genai)
    except BaseException:
        _remove_output(Path(out_path))
        raise
    if portable:  # the caller gets the file as written, not the op graph the conversion returned
        result = onnx.load(str(out_path), load_external_data=False)
    return result, deployment


def convert_file(
    in_path: str | os.PathLike | ModelRef,
    out_path: str | os.PathLike,
    revision: str | None = None,
    *,
    portable: bool = False,
    genai: GenaiOptions | None = None,
    **options,
) -> onnx.ModelProto:
    """``ortpa.convert_file``: :func:`ortpa.parity.convert_file.convert_file` (same arguments and result) plus the
    deployment step: ``portable=True`` lowers the written file to standard ONNX ops, and a ``genai_config.json``
    is written beside it (``genai``: its ``engine.dynamic_batching`` settings)."""
    result, _ = convert_deployment(in_path, out_path, portable=portable, genai=genai, revision=revision, **options)
    return result
