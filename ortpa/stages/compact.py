"""Stage data files without the bytes no stage reads any more.

A stage folder written from a checkpoint (:mod:`ortpa.conversion.staged`) starts as the data files the export
streamed each weight into; the rewrite may then replace a weight by one it computes (an absorbed MLA projection, a
cast), whose bytes are appended, and leave the original unread. :func:`compact_stages` rewrites each stage data
file that holds more than :data:`SLACK` of such bytes with only the tensors its stage references, in their order,
one chunk at a time (disk: one stage file more, for as long as it is copied; memory: one chunk), and updates the
stage's model and the manifest's sizes and digests.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from pathlib import Path

import onnx

from ortpa.runtime.stage_folder import MANIFEST, StageFile, StageManifest, sha256_file
from ortpa.stages.write import copy_range

__all__ = ["SLACK", "compact_stages", "unread_bytes"]

SLACK = 0.01  # a data file is rewritten when more than this share of it is read by no tensor (page padding excluded)
_ALIGN = 4096  # page-aligned, as the export streams them: ONNX Runtime can memory-map each tensor


def _external(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _referenced(model: onnx.ModelProto, data_name: str) -> list[onnx.TensorProto]:
    return [
        t
        for t in model.graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL and _external(t).get("location") == data_name
    ]


def unread_bytes(folder: Path, model_name: str) -> tuple[int, int]:
    """(bytes of ``<model_name>.data``, bytes of it no initializer of the stage reads, the padding after each
    tensor up to the next page not counted)."""
    data = folder / f"{model_name}.data"
    if not data.exists():
        return 0, 0
    model = onnx.load(str(folder / model_name), load_external_data=False)
    size = data.stat().st_size
    # each tensor with the padding up to the next page (what a page-aligned writer leaves), capped at the file's end
    ranges = set()
    for t in _referenced(model, data.name):
        offset, length = int(_external(t).get("offset", 0)), int(_external(t)["length"])
        ranges.add((offset, min(size, offset + length + (-(offset + length) % _ALIGN))))
    read = 0
    end = 0
    for start, stop in sorted(ranges):  # overlapping ranges (one tensor read under two names) count once
        read += max(0, stop - max(start, end))
        end = max(end, stop)
    return size, size - read


def _rewrite(folder: Path, model_name: str) -> None:
    data = folder / f"{model_name}.data"
    model = onnx.load(str(folder / model_name), load_external_data=False)
    tensors = sorted(_referenced(model, data.name), key=lambda t: int(_external(t).get("offset", 0)))
    fresh = data.with_name(data.name + ".compact")
    moved: dict[tuple[int, int], int] = {}
    with open(data, "rb") as src, open(fresh, "wb") as dst:
        for tensor in tensors:
            entries = _external(tensor)
            offset, length = int(entries.get("offset", 0)), int(entries["length"])
            if (offset, length) not in moved:
                dst.write(b"\0" * (-dst.tell() % _ALIGN))
                moved[(offset, length)] = dst.tell()
                copy_range(src, offset, length, dst.write, where=str(data), name=tensor.name)
            for entry in tensor.external_data:
                if entry.key == "offset":
                    entry.value = str(moved[(offset, length)])
            if "offset" not in entries:
                tensor.external_data.add(key="offset", value=str(moved[(offset, length)]))
    os.replace(fresh, data)
    onnx.save(model, str(folder / model_name))


def compact_stages(manifest: StageManifest) -> tuple[StageManifest, int]:
    """``manifest``'s folder with every stage data file holding more than :data:`SLACK` unread bytes rewritten
    (see the module docstring); the manifest rewritten with the files' new sizes and digests, and the bytes
    dropped."""
    folder = manifest.folder
    if folder is None:
        raise ValueError("compact_stages needs a manifest read from (or written to) a folder")
    dropped = 0
    stages = []
    for spec in manifest.stages:
        size, unread = unread_bytes(folder, spec.model)
        if size and unread > SLACK * size:
            _rewrite(folder, spec.model)
            dropped += size - (folder / f"{spec.model}.data").stat().st_size
            blob = (folder / spec.model).read_bytes()
            files = [StageFile(spec.model, len(blob), hashlib.sha256(blob).hexdigest())]
            data = folder / f"{spec.model}.data"
            files.append(StageFile(data.name, data.stat().st_size, sha256_file(data)))
            spec = dataclasses.replace(spec, files=tuple(files))
        stages.append(spec)
    compacted = dataclasses.replace(manifest, stages=tuple(stages))
    (folder / MANIFEST).write_text(compacted.to_json())
    return compacted, dropped
