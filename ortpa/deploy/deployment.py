"""A paged model file made elsewhere, finished as a deployment: ``--portable`` lowering and ``genai_config.json``.

``ortpa convert`` makes both inside its own staging folder before it publishes anything (:mod:`ortpa.conversion`);
:func:`finish_deployment` is for a paged file that exists already (onnxruntime-genai's own CUDA build of a model,
say): lowered in place with ``portable=True`` (:mod:`ortpa.deploy.portable_file`), then ``genai_config.json``
written beside it (:mod:`ortpa.deploy.genai_config`).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

from ortpa.deploy.genai_config import GenaiOptions, write_genai_config
from ortpa.deploy.portable_file import PortableInfo, lower_file

__all__ = ["Deployment", "finish_deployment"]


@dataclass(frozen=True)
class Deployment:
    """What :func:`finish_deployment` wrote next to the model."""

    model: Path
    genai_config: Path
    portable: PortableInfo | None  # None: the native op (CUDA / WebGPU)


def finish_deployment(
    model_path: str | os.PathLike,
    *,
    portable: bool = False,
    source_folder: str | os.PathLike | None = None,
    genai: GenaiOptions | None = None,
) -> Deployment:
    """Finish the paged model file ``model_path`` in place (see the module docstring)."""
    out = Path(model_path)
    (genai or GenaiOptions()).check()
    info = lower_file(out) if portable else None
    meta = dataclasses.asdict(info) if info is not None else None
    folder = Path(source_folder) if source_folder is not None else None
    config = write_genai_config(out, portable=portable, source_folder=folder, options=genai, portable_meta=meta)
    return Deployment(out, config, info)
