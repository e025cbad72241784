"""Writing a split: one ONNX file per stage with only its own weights, in its own external data, and the manifest.

Weights are copied tensor by tensor from where the source stores them (its external data, read a chunk at a time,
or the bytes of an inline tensor) to the stage's ``stage_<i>.onnx.data``: memory stays bounded by one chunk, never
the model. Tensors under :data:`~ortpa.rewriter.model_store.MIN_EXTERNAL_BYTES` stay inline, as ``convert``
writes them. Each file's SHA-256 is computed as it is written, for the manifest.

*Placed* weights (``placed=True``, :mod:`ortpa.conversion.staged`): the export has already streamed each weight into
the ``stage_<i>.onnx.data`` of the stage that reads it, in the folder the stages are written to. A tensor already in
its stage's own file is referenced where it is; any other (a weight the rewrite computed, one a second stage reads)
is appended to that file. Bytes no stage references any more (a weight the rewrite replaced) are dropped afterwards
by :func:`ortpa.stages.compact.compact_stages`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import onnx
from onnx import numpy_helper

from ortpa.errors import SplitRefused
from ortpa.rewriter.model_store import MIN_EXTERNAL_BYTES
from ortpa.runtime.stage_folder import (
    MANIFEST,
    MANIFEST_VERSION,
    BoundaryTensor,
    StageFile,
    StageManifest,
    StageSpec,
    sha256_file,
)
from ortpa.stages.partition import SplitPlan, StagePart

__all__ = ["copy_range", "write_stages"]

_CHUNK = 16 << 20
_ALIGN = 64  # each tensor starts on a 64-byte boundary of the data file (aligned loads when memory-mapped)


def copy_range(
    src: BinaryIO, offset: int, length: int, write: Callable[[bytes], object], *, where: str, name: str
) -> None:
    """``length`` bytes of ``src`` from ``offset`` through ``write``, a chunk at a time (never a whole tensor in
    memory); :class:`SplitRefused` naming ``where`` and the tensor ``name`` when the file ends before them."""
    src.seek(offset)
    left = length
    while left:
        chunk = src.read(min(_CHUNK, left))
        if not chunk:
            raise SplitRefused(where, f"external data of {name!r} ends early")
        write(chunk)
        left -= len(chunk)


class _DataFile:
    """An external data file written in order, hashed as written; ``append``: after what the file holds already
    (hashed whole when done)."""

    def __init__(self, path: Path, append: bool = False) -> None:
        self.path = path
        self.held = path.stat().st_size if append and path.exists() else 0
        self.file = open(path, "ab" if append else "wb")  # closed by close()
        self.size = self.held
        self.digest = hashlib.sha256()

    def hexdigest(self) -> str:
        return sha256_file(self.path) if self.held else self.digest.hexdigest()

    def write(self, data: bytes | memoryview) -> None:
        self.file.write(data)
        self.digest.update(data)
        self.size += len(data)

    def pad(self) -> None:
        if self.size % _ALIGN:
            self.write(b"\0" * (_ALIGN - self.size % _ALIGN))

    def close(self) -> None:
        self.file.close()


def _copy_tensor(tensor: onnx.TensorProto, base_dir: Path | None, data: _DataFile) -> onnx.TensorProto:
    """``tensor`` for the stage file: referenced where it is when it lies in ``data``'s file already (placed by the
    export), else inline when small, else its bytes appended to ``data`` and referenced."""
    out = onnx.TensorProto()
    out.CopyFrom(tensor)
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        entries = {e.key: e.value for e in tensor.external_data}
        src = Path(os.fspath(base_dir or "")) / entries["location"]
        if data.held and src.resolve() == data.path.resolve():
            return out
        offset, length = int(entries.get("offset", 0)), int(entries["length"])
        del out.external_data[:]
        if length < MIN_EXTERNAL_BYTES:
            with open(src, "rb") as f:
                f.seek(offset)
                out.raw_data = f.read(length)
            out.data_location = onnx.TensorProto.DEFAULT
            return out
        data.pad()
        start = data.size
        with open(src, "rb") as f:
            copy_range(f, offset, length, data.write, where=str(src), name=tensor.name)
    else:
        raw = tensor.raw_data if tensor.HasField("raw_data") else numpy_helper.to_array(tensor).tobytes()
        if len(raw) < MIN_EXTERNAL_BYTES:
            return out
        data.pad()
        start = data.size
        data.write(raw)
        for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
            out.ClearField(field)
        out.ClearField("raw_data")
        length = len(raw)
    out.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", data.path.name), ("offset", str(start)), ("length", str(length))):
        entry = out.external_data.add()
        entry.key, entry.value = key, value
    return out


def _boundary(types: dict[str, onnx.ValueInfoProto], name: str, label: str) -> BoundaryTensor:
    vi = types.get(name)
    if vi is None or not vi.type.tensor_type.elem_type:
        raise SplitRefused(label, f"the boundary value {name!r} has no known element type (shape inference found none)")
    tt = vi.type.tensor_type
    dims: list[int | str] = []
    for i, d in enumerate(tt.shape.dim):
        dims.append(d.dim_value if d.HasField("dim_value") else (d.dim_param or f"{name}_dim{i}"))
    return BoundaryTensor(name, onnx.TensorProto.DataType.Name(tt.elem_type).lower(), tuple(dims))


def _value_info(t: BoundaryTensor) -> onnx.ValueInfoProto:
    elem = onnx.TensorProto.DataType.Value(t.dtype.upper())
    return onnx.helper.make_tensor_value_info(t.name, elem, list(t.shape))


def _stage_model(
    source: onnx.ModelProto,
    part: StagePart,
    plan: SplitPlan,
    types: dict[str, onnx.ValueInfoProto],
    inits: dict[str, onnx.TensorProto],
    base_dir: Path | None,
    data: _DataFile,
    label: str,
) -> tuple[onnx.ModelProto, tuple[BoundaryTensor, ...], tuple[BoundaryTensor, ...]]:
    g = source.graph
    declared_in = {i.name: i for i in g.input}
    declared_out = {o.name: o for o in g.output}
    b_in = tuple(_boundary(types, n, label) for n in part.boundary_in)
    b_out = tuple(_boundary(types, n, label) for n in part.boundary_out)
    inputs = [declared_in[n] for n in plan.shared_inputs] + [declared_in[n] for n in part.cache_inputs]
    inputs += [_value_info(t) for t in b_in]
    outputs = [declared_out[n] for n in part.cache_outputs] + [_value_info(t) for t in b_out]
    if part.index == len(plan.stages) - 1:
        outputs.insert(0, declared_out["logits"])
    nodes = [source.graph.node[i] for i in part.nodes]
    for i, old, new in part.shape_reads:
        node = onnx.NodeProto()
        node.CopyFrom(source.graph.node[i])
        node.input[:] = [new if x == old else x for x in node.input]
        nodes[part.nodes.index(i)] = node
    names = {o for n in nodes for o in n.output} | {i.name for i in inputs}
    initializers = [_copy_tensor(inits[n], base_dir, data) for n in part.initializers]
    graph = onnx.helper.make_graph(
        nodes,
        f"{g.name or 'model'}_stage{part.index}",
        inputs,
        outputs,
        initializer=initializers,
        value_info=[v for v in g.value_info if v.name in names],
    )
    model = onnx.helper.make_model(graph, opset_imports=list(source.opset_import), ir_version=source.ir_version)
    model.functions.extend(source.functions)
    model.producer_name, model.producer_version = source.producer_name, source.producer_version
    for p in source.metadata_props:
        model.metadata_props.add(key=p.key, value=p.value)
    model.metadata_props.add(key="ortpa.stage", value=f"{part.index}/{len(plan.stages)}")
    model.metadata_props.add(key="ortpa.stage.layers", value=f"{part.first_layer}:{part.stop_layer}")
    return model, b_in, b_out


def write_stages(
    source: onnx.ModelProto,
    base_dir: Path | None,
    plan: SplitPlan,
    folder: Path,
    source_name: str,
    *,
    placed: bool = False,
) -> StageManifest:
    """Write every stage of ``plan`` and ``stages.json`` into ``folder`` (which must exist and be empty; with
    ``placed``, it holds the stages' data files the export streamed, see the module docstring)."""
    from ortpa.ops.shape_inference import infer_shapes

    label = source_name
    inferred = infer_shapes(_without_weights(source))
    types = {v.name: v for v in (*inferred.graph.value_info, *inferred.graph.input, *inferred.graph.output)}
    inits = {t.name: t for t in source.graph.initializer}
    specs = []
    for part in plan.stages:
        model_name = f"stage_{part.index}.onnx"
        data = _DataFile(folder / f"{model_name}.data", append=placed)
        try:
            model, b_in, b_out = _stage_model(source, part, plan, types, inits, base_dir, data, label)
        finally:
            data.close()
        blob = model.SerializeToString()
        (folder / model_name).write_bytes(blob)
        files = [StageFile(model_name, len(blob), hashlib.sha256(blob).hexdigest())]
        if data.size:
            files.append(StageFile(data.path.name, data.size, data.hexdigest()))
        else:
            data.path.unlink()
        specs.append(
            StageSpec(
                index=part.index,
                first_layer=part.first_layer,
                stop_layer=part.stop_layer,
                files=tuple(files),
                boundary_in=b_in,
                boundary_out=b_out,
                cache_inputs=part.cache_inputs,
                cache_outputs=part.cache_outputs,
                weight_bytes=part.weight_bytes,
            )
        )
    manifest = StageManifest(
        version=MANIFEST_VERSION,
        source=source_name,
        source_weight_bytes=sum(_nbytes(t) for t in source.graph.initializer),
        layers=plan.layers,
        shared_inputs=plan.shared_inputs,
        stages=tuple(specs),
        folder=folder,
    )
    (folder / MANIFEST).write_text(manifest.to_json())
    return manifest


def _nbytes(t: onnx.TensorProto) -> int:
    for e in t.external_data:
        if e.key == "length":
            return int(e.value)
    return len(t.raw_data) if t.HasField("raw_data") else numpy_helper.to_array(t).nbytes


def _without_weights(source: onnx.ModelProto) -> onnx.ModelProto:
    """The graph with its initializers as typed inputs: shape inference without reading (or copying) weights."""
    from ortpa.rewriter.ort_check import weightless

    return weightless(source, min_bytes=0)
