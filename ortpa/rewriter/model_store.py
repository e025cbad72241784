"""The loading and writing ends of the conversion pipeline, for models of any size.

Loading (:func:`load_ir`): a file is checked by :func:`ortpa.model.file.read_model` without reading its weights
and by ``onnx.checker`` from its path, then deserialized into onnx-ir with every external tensor left lazy
(``onnx_ir.ExternalTensor``, memory-mapped from the input's own folder on first use).

Writing (:func:`finish` with the sink :func:`writing_to` made for ``convert(..., out_path)``): the converted
``ir.Model`` is streamed to a private temp folder next to the output: the graph as a small protobuf, every tensor of
:data:`MIN_EXTERNAL_BYTES` or more one after the other in ``<output>.data`` (``onnx_ir.save`` reads a lazy
tensor, writes it, drops it). Weights the rewrite computes (absorbed ``W_UK``/``W_UV``) are spilled to a scratch
file after each layer (:func:`after_layer`), so they never accumulate in memory; dtype casts are lazy and
computed tensor by tensor while writing (:mod:`ortpa.rewriter.dtype`). The checks then run from the written
path: ``onnx.checker`` on the path, ortpa's node validation on the graph, and ONNX Runtime's CPU load check on
the graph with its large initializers declared as typed graph inputs (ORT resolves types and kernels without
the weights). Only then are the data file and the model moved into place: the output is complete or absent.

When external data is used: whenever the input had any, or the weights total :data:`EXTERNAL_DATA_THRESHOLD`
or more (1 GiB: protobuf caps a file at 2 GB, and an inline model costs ONNX Runtime a second copy while it
parses). The input folder is never written to.

Over ~400 lines on purpose: loading, writing and checking share the lazy external-tensor bookkeeping (which
file each tensor lives in, what was spilled, what the temp folder holds); apart they would pass it around.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx
import onnx_ir as ir

from ortpa.errors import ConversionError, InvalidModel
from ortpa.model.file import read_model
from ortpa.rewriter.ort_check import DEFAULT_PROVIDERS, check_runs, weightless

__all__ = [
    "EXTERNAL_DATA_THRESHOLD",
    "MIN_EXTERNAL_BYTES",
    "BeforeMove",
    "Sink",
    "after_layer",
    "check_session_from_path",
    "finish",
    "inline_copy",
    "load_ir",
    "save_model",
    "writing_to",
]

EXTERNAL_DATA_THRESHOLD = 2**30  # weights past this go to external data even when the input had none
MIN_EXTERNAL_BYTES = 1024  # tensors below stay in the protobuf (shapes, scalars: what ORT folds at load)
_IN_FLIGHT_BYTES = 256 * 2**20  # onnx_ir.save's read-ahead budget while writing external data
_PROTOBUF_LIMIT = 2**31 - 2**20

Progress = Callable[[str], None]
BeforeMove = Callable[[Path], Mapping[str, str] | None]


def _say(progress: Progress | None, message: str) -> None:
    if progress is not None:
        progress(message)


# ------------------------------------------------------------------------------------------ loading
def load_ir(model: onnx.ModelProto | ir.Model | str | os.PathLike, sink: Sink | None = None) -> ir.Model:
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
    layers = getattr(sink.progress, "layers", None) if sink is not None else None
    if layers is not None:  # a progress display that shows "layer i/n"
        layers(layer_count(irm))
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


def layer_count(irm: ir.Model) -> int:
    """Layers the conversion will rewrite, for progress: the model's past_key_values.{i}.key inputs."""
    return sum(1 for v in irm.graph.inputs if v.name.startswith("past_key_values.") and v.name.endswith(".key"))


# ------------------------------------------------------------------------------------------ the sink
@dataclass
class Sink:
    """Where :func:`finish` writes: the final path and a private temp folder next to it, made on first use
    (nothing is created next to the output before the conversion has something to write)."""

    out: Path
    progress: Progress | None = None
    scratch: Path | None = None  # computed weights spilled per layer
    scratch_size: int = 0
    inputs: frozenset[Path] = field(default_factory=frozenset)  # the input model file, never to be replaced
    force_external: bool = False
    _tmp: Path | None = None
    _made: list[Path] = field(default_factory=list)  # folders this conversion created, removed on failure

    @property
    def tmp(self) -> Path:
        if self._tmp is None:
            missing = [p for p in [self.out.parent, *self.out.parent.parents] if not p.exists()]
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self._made = missing  # deepest first
            self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.", suffix=".tmp", dir=self.out.parent))
        return self._tmp

    def cleanup(self, failed: bool) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        if failed:
            for folder in self._made:
                with contextlib.suppress(OSError):
                    folder.rmdir()  # only when still empty


@contextlib.contextmanager
def writing_to(out_path: str | os.PathLike, progress: Progress | None = None) -> Iterator[Sink]:
    """A :class:`Sink` for ``out_path``: hand it to :func:`load_ir`, :func:`after_layer` and :func:`finish`.
    The temp folder is removed on any exit (success has moved its files out already), and on failure so are the
    output's parent folders this call created."""
    sink = Sink(Path(out_path), progress)
    failed = True
    try:
        yield sink
        failed = False
    finally:
        sink.cleanup(failed)


def after_layer(irm: ir.Model, sink: Sink | None) -> None:
    """When writing to a file (``sink`` given): move every computed in-memory initializer of
    :data:`MIN_EXTERNAL_BYTES` or more to the scratch file, so the next layer starts with only the model's
    (memory-mapped) weights in memory."""
    if sink is None:
        return
    if sink.scratch is None:
        sink.scratch = sink.tmp / "computed.scratch"
    with open(sink.scratch, "ab") as f:
        for value in irm.graph.initializers.values():
            tensor = value.const_value
            if tensor is None or isinstance(tensor, (ir.ExternalTensor, ir.LazyTensor)):
                continue
            if tensor.nbytes < MIN_EXTERNAL_BYTES:
                continue
            data = tensor.tobytes()
            offset = sink.scratch_size
            f.write(data)
            sink.scratch_size += len(data)
            value.const_value = ir.ExternalTensor(
                sink.scratch.name,
                offset,
                len(data),
                tensor.dtype,
                shape=tensor.shape,
                name=tensor.name or value.name,
                base_dir=sink.tmp,
            )


# ------------------------------------------------------------------------------------------ finishing
def finish(
    irm: ir.Model,
    sink: Sink | None,
    progress: Progress | None,
    providers: Sequence[str],
    before_move: BeforeMove | None = None,
) -> onnx.ModelProto:
    """The converted model, checked: an in-memory proto (``sink`` None), or the written file's graph (its tensors
    stored externally reference ``<output>.data`` next to the output).

    ``before_move(tmp_model_path)`` runs on the complete, checked model in the temp folder, before anything is
    moved into place (the conversion's verification): it raises to stop the write, or returns metadata entries
    to stamp into the written model."""
    if sink is None:
        return _serialize_checked(irm, progress, providers)
    _write(irm, sink, progress)
    _say(progress, "checking")
    tmp_model = sink.tmp / sink.out.name
    try:
        onnx.checker.check_model(str(tmp_model), full_check=False)
    except Exception as exc:
        raise ConversionError("the converted model fails onnx.checker", [("model", str(exc)[:2000])]) from exc
    header = onnx.load(str(tmp_model), load_external_data=False)
    _validate(header)
    if providers:
        check_session_from_path(header, providers, progress)
    if before_move is not None:
        extra = before_move(tmp_model)
        if extra:
            header = _stamp_metadata(tmp_model, extra)
    _move_into_place(sink)
    _say(progress, "done")
    if _has_external(header):
        return header
    return onnx.load(str(sink.out))


def _stamp_metadata(path: Path, entries: Mapping[str, str]) -> onnx.ModelProto:
    """Add (or replace) metadata entries of the model at ``path``, its external data left where it is."""
    proto = onnx.load(str(path), load_external_data=False)
    kept = [p for p in proto.metadata_props if p.key not in entries]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    for key, value in entries.items():
        proto.metadata_props.add(key=key, value=value)
    onnx.save(proto, str(path))
    return proto


def _total_bytes(irm: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in irm.graph.initializers.values() if v.const_value is not None)


def _has_external_input(irm: ir.Model, scratch_dir: Path) -> bool:
    """Whether the input stored weights externally (tensors spilled by :func:`after_layer` do not count)."""
    return any(
        isinstance(t := v.const_value, ir.ExternalTensor) and Path(t.base_dir) != scratch_dir
        for v in irm.graph.initializers.values()
    )


def _write(irm: ir.Model, sink: Sink, progress: Progress | None) -> None:
    total = _total_bytes(irm)
    external = sink.force_external or _has_external_input(irm, sink.tmp) or total >= EXTERNAL_DATA_THRESHOLD
    data_name = sink.out.name + ".data"
    target = (sink.out.parent / data_name).resolve()
    inputs = set(sink.inputs) | {
        Path(t.path).resolve()
        for v in irm.graph.initializers.values()
        if isinstance(t := v.const_value, ir.ExternalTensor) and Path(t.base_dir) != sink.tmp
    }
    if target in inputs:
        raise ConversionError(
            f"cannot write {sink.out}: its data file {data_name} is the input's own external data",
            [("out_path", str(sink.out))],
        )
    _say(progress, f"writing {total / 1e6:.0f} MB of weights" + (f" to {data_name}" if external else ""))
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
        bytes_progress = getattr(progress, "bytes", None)
        if bytes_progress is not None:
            bytes_progress(done, streamed)

    tmp_model = sink.tmp / sink.out.name
    try:
        if external:
            ir.save(
                irm,
                tmp_model,
                external_data=data_name,
                size_threshold_bytes=MIN_EXTERNAL_BYTES,
                callback=on_tensor,
                max_workers=1,
                max_in_flight_bytes=_IN_FLIGHT_BYTES,
            )
        else:  # under the threshold: the whole model inline, spilled and memory-mapped tensors read in
            ir.save(ir.external_data.load_to_model(irm), tmp_model)
    except ValueError as exc:  # protobuf refuses a graph past 2 GB even without its weights
        raise ConversionError(f"cannot write {sink.out}: {exc}") from exc
    except OSError as exc:
        raise ConversionError(f"cannot write {sink.out}: {exc.strerror or exc}") from exc


def _move_into_place(sink: Sink) -> None:
    """Data file first, model last; an existing output is removed first, so a crash in between leaves no model
    (never an old model next to a new data file)."""
    data_name = sink.out.name + ".data"
    tmp_data = sink.tmp / data_name
    try:
        if tmp_data.exists():
            if sink.out.exists() or sink.out.is_symlink():
                os.unlink(sink.out)
            os.replace(tmp_data, sink.out.parent / data_name)
        os.replace(sink.tmp / sink.out.name, sink.out)
    except OSError as exc:
        raise ConversionError(f"cannot write {sink.out}: {exc.strerror or exc}") from exc


def _has_external(proto: onnx.ModelProto) -> bool:
    return any(t.data_location == onnx.TensorProto.EXTERNAL for t in proto.graph.initializer)


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


def _serialize_checked(irm: ir.Model, progress: Progress | None, providers: Sequence[str]) -> onnx.ModelProto:
    """Serialize, then onnx.checker, ortpa's node validation and ORT's session check on ``providers``."""
    proto = inline_copy(irm)
    _say(progress, "checking")
    try:
        onnx.checker.check_model(proto, full_check=False)
    except Exception as exc:
        raise ConversionError("the converted model fails onnx.checker", [("model", str(exc)[:2000])]) from exc
    _validate(proto)
    if providers:
        check_session_from_path(proto, providers, progress)
    _say(progress, "done")
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


# ------------------------------------------------------------------------------------------ files
def save_model(proto: onnx.ModelProto, out_path: str | os.PathLike) -> None:
    """Write an in-memory proto atomically (temp folder next to the target, then moved); ``proto`` is not
    modified. External data (``<out>.data``) when its weights reach :data:`EXTERNAL_DATA_THRESHOLD`."""
    out = Path(out_path)
    with writing_to(out) as sink:
        irm = ir.serde.deserialize_model(proto)
        total = _total_bytes(irm)
        if total >= EXTERNAL_DATA_THRESHOLD or proto.ByteSize() > _PROTOBUF_LIMIT:
            sink.force_external = True
        _write(irm, sink, None)
        _move_into_place(sink)
