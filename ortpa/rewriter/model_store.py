"""The loading and writing ends of a conversion, for models of any size.

Loading (:func:`load_ir`): a file is checked by :func:`ortpa.model.file.read_model` without reading its weights
and by ``onnx.checker`` from its path, then deserialized into onnx-ir with every external tensor left lazy
(``onnx_ir.ExternalTensor``, memory-mapped from the input's own folder on first use).

Writing (:func:`write`, into the folder the orchestrator stages the output in): the converted ``ir.Model`` is
streamed to a path: the graph as a small protobuf, every tensor of :data:`MIN_EXTERNAL_BYTES` or more one after
the other in ``<model>.data`` (``onnx_ir.save`` reads a lazy tensor, writes it, drops it). Weights the rewrite
computes (absorbed ``W_UK``/``W_UV``) are moved to a scratch file after each layer (:class:`Spill`), so they never
accumulate in memory; dtype casts are lazy and computed tensor by tensor while writing
(:mod:`ortpa.rewriter.dtype`). :func:`check_written` then checks from the written path: ``onnx.checker`` on the
path, ortpa's node validation on the graph, and ONNX Runtime opening the graph with its large initializers
declared as typed graph inputs (ORT resolves types and kernels without the weights). :func:`checked_proto` is the
same for the in-memory conversion.

When external data is used: whenever the input had any, or the weights total :data:`EXTERNAL_DATA_THRESHOLD`
or more (1 GiB: protobuf caps a file at 2 GB, and an inline model costs ONNX Runtime a second copy while it
parses). The input folder is never written to.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import onnx
import onnx_ir as ir

from ortpa.errors import ConversionError, InvalidModel
from ortpa.model.file import read_model
from ortpa.progress import BytesWritten, Progress, Stage, report
from ortpa.rewriter.ort_check import DEFAULT_PROVIDERS, check_runs, weightless

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "MIN_EXTERNAL_BYTES",
    "Spill",
    "check_session_from_path",
    "check_written",
    "checked_proto",
    "inline_copy",
    "load_ir",
    "write",
    "write_in_place",
]

EXTERNAL_DATA_THRESHOLD = 2**30  # weights past this go to external data even when the input had none
MIN_EXTERNAL_BYTES = 1024  # tensors below stay in the protobuf (shapes, scalars: what ORT folds at load)
_IN_FLIGHT_BYTES = 256 * 2**20  # onnx_ir.save's read-ahead budget while writing external data


# ------------------------------------------------------------------------------------------ loading
def load_ir(model: onnx.ModelProto | ir.Model | str | os.PathLike) -> ir.Model:
    """A private ir.Model: the caller's model object is never modified.

    Paths: checked by the shared loader without reading the weights, by onnx.checker on the graph (weights as
    typed inputs), external tensors left lazy (memory-mapped from the input folder when read). ModelProtos go
    through the same loader with their data inline. The input must pass onnx.checker, which the converted model
    has to pass anyway: a model it rejects would otherwise fail somewhere deep in the optimizer with an unrelated
    message.
    """
    if isinstance(model, ir.Model):  # the caller's own in-memory object: a private copy, as before
        return ir.serde.deserialize_model(ir.serde.serialize_model(model))
    if not isinstance(model, (onnx.ModelProto, str, os.PathLike)):
        raise TypeError(f"expected onnx.ModelProto, onnx_ir.Model or a path, got {type(model).__name__}")
    from_path = not isinstance(model, onnx.ModelProto)
    loaded = read_model(model, load_external_data=not from_path)
    try:
        # the graph with its large weights as typed inputs: the checker neither reads the weights nor follows
        # external references itself (it would resolve them against the working directory, and refuses the
        # symlinks of a Hugging Face cache that read_model has already checked)
        onnx.checker.check_model(weightless(loaded.proto) if from_path else loaded.proto, full_check=False)
    except onnx.checker.ValidationError as exc:
        reason = " ".join(str(exc).split())
        raise InvalidModel(loaded.label, f"fails onnx.checker: {reason[:500]}") from None
    except ValueError:  # an in-memory proto over 2 GB: ONNX Runtime checks the written model at the end
        pass
    irm = ir.serde.deserialize_model(loaded.proto)
    if loaded.base_dir is not None:
        ir.external_data.set_base_dir(irm.graph, loaded.base_dir)
        _point_at_checked_targets(irm, loaded.external)
    return irm


def _point_at_checked_targets(irm: ir.Model, refs) -> None:
    """External tensors whose file is a symlink read_model accepted (a Hugging Face cache's ``blobs/``) are
    pointed at the resolved file: onnx_ir refuses any symlink that leaves the model's folder, the loader has
    already decided which ones may."""
    targets = {ref.location: Path(ref.path) for ref in refs}
    for value in irm.graph.initializers.values():
        tensor = value.const_value
        if not isinstance(tensor, ir.ExternalTensor) or tensor.location not in targets:
            continue
        target = targets[tensor.location]
        if Path(os.path.realpath(tensor.base_dir)) == target.parent:
            continue
        value.const_value = ir.ExternalTensor(
            target.name,
            tensor.offset,
            tensor.length,
            tensor.dtype,
            shape=tensor.shape,
            name=tensor.name,
            base_dir=target.parent,
        )


# ------------------------------------------------------------------------------------------ spilling
class Spill:
    """Weights the rewrite computes, moved out of memory after each layer: every computed in-memory initializer of
    :data:`MIN_EXTERNAL_BYTES` or more is appended to one scratch file in ``folder`` and read back lazily, so the
    next layer starts with only the model's (memory-mapped) weights in memory."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self.path = self.folder / "computed.scratch"
        self.size = 0

    def __call__(self, irm: ir.Model) -> None:
        with open(self.path, "ab") as f:
            for value in irm.graph.initializers.values():
                tensor = value.const_value
                if tensor is None or isinstance(tensor, (ir.ExternalTensor, ir.LazyTensor)):
                    continue
                if tensor.nbytes < MIN_EXTERNAL_BYTES:
                    continue
                data = tensor.tobytes()
                offset = self.size
                f.write(data)
                self.size += len(data)
                value.const_value = ir.ExternalTensor(
                    self.path.name,
                    offset,
                    len(data),
                    tensor.dtype,
                    shape=tensor.shape,
                    name=tensor.name or value.name,
                    base_dir=self.folder,
                )


# ------------------------------------------------------------------------------------------ writing and checking
def check_written(path: Path, providers: Sequence[str], progress: Progress | None = None) -> onnx.ModelProto:
    """The written model at ``path``, checked: onnx.checker on the path, every PagedAttention node validated, and
    ONNX Runtime opening the graph on each of ``providers``. Its graph (external data not read)."""
    report(progress, Stage.CHECK, "checking")
    try:
        onnx.checker.check_model(str(path), full_check=False)
    except Exception as exc:
        raise ConversionError("the converted model fails onnx.checker", [("model", str(exc)[:2000])]) from exc
    header = onnx.load(str(path), load_external_data=False)
    _validate(header)
    if providers:
        check_session_from_path(header, providers, progress)
    return header


def _total_bytes(irm: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in irm.graph.initializers.values() if v.const_value is not None)


def write(
    irm: ir.Model,
    path: Path,
    progress: Progress | None = None,
    *,
    scratch: Path | None = None,
    final_data: Path | None = None,
    force_external: bool = False,
) -> None:
    """Stream ``irm`` to ``path`` (and ``<path>.data`` when external, see the module docstring).

    ``scratch``: the folder of the :class:`Spill` (its tensors are no input weights). ``final_data``: where the
    data file will end up, refused when that is a file the input's own weights are read from."""
    total = _total_bytes(irm)
    inputs = {
        Path(t.path).resolve()
        for v in irm.graph.initializers.values()
        if isinstance(t := v.const_value, ir.ExternalTensor) and (scratch is None or Path(t.base_dir) != scratch)
    }
    external = force_external or bool(inputs) or total >= EXTERNAL_DATA_THRESHOLD
    data_name = path.name + ".data"
    if final_data is not None and final_data.resolve() in inputs:
        raise ConversionError(
            f"cannot write {final_data.parent / path.name}: its data file {data_name} is the input's own external data",
            [("out_path", str(final_data.parent / path.name))],
        )
    report(progress, Stage.WRITE, f"writing {total / 1e6:.0f} MB of weights" + (f" to {data_name}" if external else ""))
    done = 0
    # what the callback will report: the tensors that go to the data file (smaller ones stay in the graph)
    streamed = sum(
        v.const_value.nbytes
        for v in irm.graph.initializers.values()
        if v.const_value is not None and v.const_value.nbytes >= MIN_EXTERNAL_BYTES
    )

    def on_tensor(tensor: ir.TensorProtocol, info) -> None:
        nonlocal done
        done += tensor.nbytes
        if progress is not None:
            progress(BytesWritten(done, streamed))

    try:
        if external:
            ir.save(
                irm,
                path,
                external_data=data_name,
                size_threshold_bytes=MIN_EXTERNAL_BYTES,
                callback=on_tensor,
                max_workers=1,
                max_in_flight_bytes=_IN_FLIGHT_BYTES,
            )
        else:  # under the threshold: the whole model inline, spilled and memory-mapped tensors read in
            ir.save(ir.external_data.load_to_model(irm), path)
    except ValueError as exc:  # protobuf refuses a graph past 2 GB even without its weights
        raise ConversionError(f"cannot write {path.name}: {exc}") from exc
    except OSError as exc:
        raise ConversionError(f"cannot write {path.name}: {exc.strerror or exc}") from exc


def write_in_place(irm: ir.Model, path: Path, progress: Progress | None = None) -> int:
    """``irm``'s graph written to ``path`` with every external tensor that lies in ``path``'s folder referenced
    where it is (weights an export streamed there, the :class:`Spill` of a rewrite run there); any other tensor of
    :data:`MIN_EXTERNAL_BYTES` or more (a lazy cast, a tensor read from elsewhere) appended to ``<path>.data`` one
    at a time. For a model whose weights must never be copied into one file (pipeline stages written from a
    checkpoint). Returns the bytes appended."""
    folder = path.parent.resolve()
    data = path.with_name(path.name + ".data")
    report(progress, Stage.WRITE, f"writing the graph of {path.name}, its weights referenced where they are")
    size = 0
    try:
        with open(data, "wb") as f:
            for value in irm.graph.initializers.values():
                tensor = value.const_value
                if tensor is None or tensor.nbytes < MIN_EXTERNAL_BYTES:
                    if isinstance(tensor, ir.ExternalTensor):  # small: inline, as write() keeps it
                        value.const_value = ir.Tensor(tensor.numpy(), name=tensor.name)
                    continue
                if isinstance(tensor, ir.ExternalTensor) and Path(tensor.base_dir).resolve() == folder:
                    continue
                raw = tensor.tobytes()
                f.write(b"\0" * (-size % 4096))  # page-aligned, as the export streams weights
                offset = size + (-size % 4096)
                f.write(raw)
                size = offset + len(raw)
                value.const_value = ir.ExternalTensor(
                    data.name, offset, len(raw), tensor.dtype, shape=tensor.shape, name=value.name, base_dir=folder
                )
        onnx.save(ir.serde.serialize_model(irm), str(path))
    except ValueError as exc:
        raise ConversionError(f"cannot write {path.name}: {exc}") from exc
    except OSError as exc:
        raise ConversionError(f"cannot write {path.name}: {exc.strerror or exc}") from exc
    if not size:
        data.unlink()
    return size


def inline_copy(irm: ir.Model) -> onnx.ModelProto:
    """``irm`` as one in-memory ModelProto, memory-mapped tensors read in (``irm`` itself stays lazy): for the
    in-memory API and the int8 calibration, which run the model from bytes."""
    proto = ir.serde.serialize_model(irm)
    lazy = {name: t for name, v in irm.graph.initializers.items() if isinstance(t := v.const_value, ir.ExternalTensor)}
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL and tensor.name in lazy:
            tensor.raw_data = lazy[tensor.name].tobytes()  # onnx_ir reads it from the checked folder
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    return proto


def checked_proto(irm: ir.Model, progress: Progress | None, providers: Sequence[str]) -> onnx.ModelProto:
    """The in-memory conversion's end: serialized, then onnx.checker, ortpa's node validation and ONNX Runtime's
    session check on ``providers``."""
    proto = inline_copy(irm)
    report(progress, Stage.CHECK, "checking")
    try:
        onnx.checker.check_model(proto, full_check=False)
    except Exception as exc:
        raise ConversionError("the converted model fails onnx.checker", [("model", str(exc)[:2000])]) from exc
    _validate(proto)
    if providers:
        check_session_from_path(proto, providers, progress)
    return proto


def _validate(proto: onnx.ModelProto) -> None:
    """Every PagedAttention node against ONNX Runtime's rules (ortpa.ops.validate), for the CUDA backend."""
    from ortpa.ops.validate import validate_model

    report = validate_model(proto, backend="cuda")
    if not report.ok:
        raise ConversionError("the converted model has invalid PagedAttention nodes", _report_pairs(report))


def _report_pairs(report) -> list[tuple[str, str]]:
    """(node, problem) pairs from an ortpa.ops.validate report: rule errors and backend gaps."""
    pairs = []
    for node in getattr(report, "nodes", ()):
        pairs += [(node.node, f"[{rule}] {name}: {msg}") for rule, name, msg in node.errors]
        pairs += [(node.node, f"not implemented by {b}: {f}: {d}") for b, f, d in node.backend_errors]
    return pairs or [("model", report.format() if hasattr(report, "format") else str(report))]


def check_session_from_path(
    proto: onnx.ModelProto, providers: Sequence[str] = DEFAULT_PROVIDERS, progress: Progress | None = None
) -> None:
    """ONNX Runtime must open the converted graph on every provider in ``providers`` (:mod:`.ort_check`)."""
    check_runs(proto, providers, progress)
