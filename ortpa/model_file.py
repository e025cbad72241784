"""The one way ortpa reads an ONNX model: a path, bytes, an ``onnx.ModelProto`` or an ``onnx_ir.Model``.

Every command (``convert``, ``validate``, ``generate``, ``parity``) and every API entry point that takes a model
goes through :func:`read_model`, so a hostile file gets the same clear :class:`~ortpa.errors.InvalidModel`
(``"<path>: <reason>"``) everywhere, and never a traceback, a huge allocation or a read outside its folder.

What is checked, in this order, before any weight is read:

1. the file: exists, is a regular file, is not empty, parses as a ``ModelProto`` with an ``ir_version``, an
   ``opset_import`` and a graph (truncated and corrupted files fail here);
2. every tensor (initializers, sparse initializers, ``Constant``-style attributes, subgraphs, functions): a known
   element type, non-negative dims, a byte size that does not overflow int64, and inline ``raw_data`` of exactly
   that size; sizes are computed with Python ints and nothing of that size is allocated;
3. every external-data reference: a relative ``location`` without ``..``, resolving (symlinks included) to a
   regular file inside the model's folder, with ``offset + size`` inside that file; a model given as bytes or
   a ``ModelProto`` has no folder, so its external references are refused when the data is needed (sessions,
   convert) and left alone when it is not (``validate``, ``load_external_data=False``);
4. every string is valid UTF-8; nodes only use domains the model imports (a ``PagedAttention`` without a
   ``com.microsoft`` import), and default-domain ops exist in the model's opset with that many inputs/outputs;
5. ONNX Runtime can load models of this ``ir_version`` and these opset versions (asked of ORT itself on an
   empty graph with the same header, so the answer follows the installed ORT, not a table here).

onnx 1.23's own ``onnx.load`` also refuses absolute, ``..`` and symlinked locations and offsets past the end;
``onnx_ir.load`` refuses escapes but not a length past the end; ORT refuses all of these, but from bytes it
refuses external data outright. We check first, with one message format, then read the data ourselves.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ortpa.errors import InvalidModel

__all__ = [
    "ExternalRef",
    "LoadedModel",
    "check_ort_version_support",
    "ort_message_line",
    "read_model",
    "tensor_nbytes",
]

# bytes past which a declared tensor is refused outright: int64 byte counts overflow beyond it in ORT and numpy
_MAX_TENSOR_BYTES = 2**62

# bits per element of every fixed-size ONNX element type (STRING has no fixed size)
_BITS: dict[int, int] = {
    onnx.TensorProto.FLOAT: 32,
    onnx.TensorProto.UINT8: 8,
    onnx.TensorProto.INT8: 8,
    onnx.TensorProto.UINT16: 16,
    onnx.TensorProto.INT16: 16,
    onnx.TensorProto.INT32: 32,
    onnx.TensorProto.INT64: 64,
    onnx.TensorProto.BOOL: 8,
    onnx.TensorProto.FLOAT16: 16,
    onnx.TensorProto.DOUBLE: 64,
    onnx.TensorProto.UINT32: 32,
    onnx.TensorProto.UINT64: 64,
    onnx.TensorProto.COMPLEX64: 64,
    onnx.TensorProto.COMPLEX128: 128,
    onnx.TensorProto.BFLOAT16: 16,
}
for _name, _bits in [
    ("FLOAT8E4M3FN", 8),
    ("FLOAT8E4M3FNUZ", 8),
    ("FLOAT8E5M2", 8),
    ("FLOAT8E5M2FNUZ", 8),
    ("FLOAT8E8M0", 8),
    ("UINT4", 4),
    ("INT4", 4),
    ("FLOAT4E2M1", 4),
    ("UINT2", 2),
    ("INT2", 2),
]:
    if hasattr(onnx.TensorProto, _name):  # newer element types exist only in newer onnx releases
        _BITS[getattr(onnx.TensorProto, _name)] = _bits


@dataclass(frozen=True)
class ExternalRef:
    """One validated external-data reference: ``nbytes`` bytes at ``offset`` of ``path`` (inside the folder)."""

    tensor: str
    location: str
    path: Path
    offset: int
    nbytes: int


@dataclass(frozen=True)
class LoadedModel:
    """A checked model: ``proto`` (external data inlined unless asked not to), a ``label`` for messages, the
    model's folder (``None`` for bytes / in-memory models) and the external references that were checked."""

    proto: onnx.ModelProto
    label: str
    base_dir: Path | None
    external: tuple[ExternalRef, ...]


# ------------------------------------------------------------------------------------------ entry point
def read_model(
    model: Any, *, load_external_data: bool = True, copy: bool = True, check_runtime: bool = True
) -> LoadedModel:
    """Read and check ``model`` (path, bytes, ``onnx.ModelProto`` or ``onnx_ir.Model``); :class:`InvalidModel`
    with the file and the reason when it is not a model ONNX Runtime could load.

    ``load_external_data=False`` validates external references (when there is a folder to resolve them in)
    but leaves them in the proto. ``copy=False`` returns a caller's ``ModelProto`` itself.
    ``check_runtime=False`` skips step 5, for static checks (``validate``) of models no session will load.
    A :class:`LoadedModel` (already checked) passes through with its label, its proto copied unless
    ``copy=False``: layers that read a model once and hand it on keep naming the file in their errors.
    """
    if isinstance(model, LoadedModel):
        if not copy:
            return model
        proto = onnx.ModelProto()
        proto.CopyFrom(model.proto)
        return dataclasses.replace(model, proto=proto)
    if isinstance(model, onnx.ModelProto):
        proto, label, base_dir = model, "<ModelProto>", None
        if copy:
            proto = onnx.ModelProto()
            proto.CopyFrom(model)
    elif isinstance(model, (bytes, bytearray, memoryview)):
        proto, label, base_dir = _parse(bytes(model), "<bytes>"), "<bytes>", None
    elif type(model).__module__.startswith("onnx_ir"):
        import onnx_ir as ir

        proto, label, base_dir = ir.serde.serialize_model(model), "<onnx_ir.Model>", None
    elif isinstance(model, (str, os.PathLike)):
        label = os.fspath(model)
        proto = _parse(_read_file(label), label)
        # the folder the caller named (not the target of a symlinked model file): external data must live in it
        base_dir = Path(os.path.dirname(os.path.abspath(label)))
    else:
        raise InvalidModel(
            repr(model)[:80], f"expected a path, bytes, onnx.ModelProto or onnx_ir.Model, got {type(model).__name__}"
        )
    _check_header(proto, label)
    _check_strings(proto, label, "model")
    refs = _check_tensors(proto, label, base_dir, need_data=load_external_data)
    _check_domains(proto, label)
    if check_runtime:
        check_ort_version_support(proto, label)
    if refs and load_external_data:
        _inline_external(proto, refs, label)
    return LoadedModel(proto, label, base_dir, refs)


# ------------------------------------------------------------------------------------------ the file
def _read_file(path: str) -> bytes:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise InvalidModel(path, "no such file") from None
    except OSError as exc:
        raise InvalidModel(path, f"cannot read: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise InvalidModel(path, "is a directory, expected an .onnx file")
    if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or never end
        raise InvalidModel(path, "not a regular file, expected an .onnx file")
    if st.st_size == 0:
        raise InvalidModel(path, "empty file (0 bytes), not an ONNX model")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise InvalidModel(path, f"cannot read: {exc.strerror}") from None


def _parse(data: bytes, label: str) -> onnx.ModelProto:
    if not data:
        raise InvalidModel(label, "empty file (0 bytes), not an ONNX model")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception:  # protobuf's DecodeError and friends: say it plainly, no traceback
        raise InvalidModel(
            label,
            f"not an ONNX model: protobuf parsing of its {len(data)} bytes failed "
            "(truncated, corrupted or another format)",
        ) from None
    return proto


def _check_header(proto: onnx.ModelProto, label: str) -> None:
    # arbitrary bytes sometimes parse as a message; a real model always names its IR version, opsets and graph
    if proto.ir_version <= 0:
        raise InvalidModel(label, "not an ONNX model: no ir_version (truncated, corrupted or another format)")
    if not proto.opset_import:
        raise InvalidModel(label, "not an ONNX model: no opset_import (truncated, corrupted or another format)")
    if not proto.HasField("graph"):
        raise InvalidModel(label, "not an ONNX model: no graph (truncated, corrupted or another format)")
    for op in proto.opset_import:
        if op.version < 1:
            raise InvalidModel(
                label, f"opset_import of domain {op.domain or 'ai.onnx'!r} has version {op.version}, expected >= 1"
            )


def _check_strings(message: Any, label: str, where: str) -> None:
    """Every string field is valid UTF-8. ONNX is proto2, so protobuf does not check: a corrupted name comes
    back as ``bytes``, and ORT and onnx.helper then fail with a UnicodeDecodeError instead of a clear message."""
    for field, value in message.ListFields():
        if field.type == field.TYPE_STRING:
            values = value if field.is_repeated else [value]
            for v in values:
                if not isinstance(v, str):
                    raise InvalidModel(label, f"{where}.{field.name} {bytes(v)[:40]!r} is not valid UTF-8 (corrupted)")
        elif field.type == field.TYPE_MESSAGE:
            if field.is_repeated:
                for i, item in enumerate(value):
                    _check_strings(item, label, f"{where}.{field.name}[{i}]")
            else:
                _check_strings(value, label, f"{where}.{field.name}")


# ------------------------------------------------------------------------------------------ tensors
def tensor_nbytes(tensor: onnx.TensorProto, label: str) -> int | None:
    """Declared byte size of ``tensor`` from dims and element type (``None`` for strings), checked."""
    where = f"tensor {tensor.name!r}"
    if tensor.data_type not in _BITS and tensor.data_type != onnx.TensorProto.STRING:
        raise InvalidModel(label, f"{where}: unknown element type {tensor.data_type}")
    count = 1
    for d in tensor.dims:
        if d < 0:
            raise InvalidModel(label, f"{where}: negative dimension {d} in dims {list(tensor.dims)}")
        count *= d  # a Python int: no overflow, and nothing of this size is allocated
    if tensor.data_type == onnx.TensorProto.STRING:
        return None
    nbytes = (count * _BITS[tensor.data_type] + 7) // 8
    if nbytes > _MAX_TENSOR_BYTES:
        raise InvalidModel(
            label, f"{where}: dims {list(tensor.dims)} declare {nbytes} bytes, more than any machine holds"
        )
    return nbytes


def _tensors(proto: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto in the model: graph and subgraphs, attributes, sparse tensors and functions."""

    def from_attr(attr: onnx.AttributeProto) -> Iterator[onnx.TensorProto]:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        for sparse in [attr.sparse_tensor] if attr.HasField("sparse_tensor") else []:
            yield sparse.values
            yield sparse.indices
        for sparse in attr.sparse_tensors:
            yield sparse.values
            yield sparse.indices
        if attr.HasField("g"):
            yield from from_graph(attr.g)
        for g in attr.graphs:
            yield from from_graph(g)

    def from_nodes(nodes) -> Iterator[onnx.TensorProto]:
        for node in nodes:
            for attr in node.attribute:
                yield from from_attr(attr)

    def from_graph(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield sparse.values
            yield sparse.indices
        yield from from_nodes(graph.node)

    yield from from_graph(proto.graph)
    for fn in proto.functions:
        yield from from_nodes(fn.node)


def _check_tensors(
    proto: onnx.ModelProto, label: str, base_dir: Path | None, need_data: bool
) -> tuple[ExternalRef, ...]:
    refs = []
    for tensor in _tensors(proto):
        nbytes = tensor_nbytes(tensor, label)
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            if base_dir is None and not need_data:
                continue  # nothing will follow the reference (static validation of an in-memory model)
            refs.append(_check_external(tensor, nbytes, label, base_dir))
        elif tensor.HasField("raw_data") and nbytes is not None and len(tensor.raw_data) != nbytes:
            raise InvalidModel(
                label,
                f"tensor {tensor.name!r}: dims {list(tensor.dims)} need {nbytes} bytes, "
                f"raw_data holds {len(tensor.raw_data)}",
            )
    return tuple(refs)


# ------------------------------------------------------------------------------------------ external data
def _check_external(tensor: onnx.TensorProto, nbytes: int | None, label: str, base_dir: Path | None) -> ExternalRef:
    """Validate one reference without opening it: only ``os.stat`` of a path already known to be inside."""
    where = f"tensor {tensor.name!r}: external data"
    entries = {e.key: e.value for e in tensor.external_data}
    location = entries.get("location", "")
    if base_dir is None:
        raise InvalidModel(
            label,
            f"{where} {location!r} cannot be resolved without the model's folder; pass the model's path instead",
        )
    if nbytes is None:
        raise InvalidModel(label, f"{where}: string tensors cannot be stored as external data")
    if not location:
        raise InvalidModel(label, f"{where} has no location")
    if "\0" in location:
        raise InvalidModel(label, f"{where} location {location!r} contains a NUL byte")
    parts = re.split(r"[\\/]", location)
    if os.path.isabs(location) or location.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", location):
        raise InvalidModel(label, f"{where} location {location!r} is absolute; expected a file in {base_dir}")
    if ".." in parts:
        raise InvalidModel(label, f"{where} location {location!r} contains '..'; expected a file in {base_dir}")
    offset = _int_entry(entries, "offset", 0, where, label)
    length = _int_entry(entries, "length", None, where, label)
    folder = os.path.realpath(base_dir)
    target = os.path.realpath(os.path.join(folder, location))  # resolves every symlink on the way
    if os.path.commonpath([folder, target]) != folder:
        raise InvalidModel(
            label, f"{where} location {location!r} resolves to {target}, outside the model's folder {folder}"
        )
    try:
        st = os.stat(target)
    except OSError:
        raise InvalidModel(label, f"{where} file {location!r} not found in {folder}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidModel(label, f"{where} location {location!r} is not a regular file")
    if length is not None and length != nbytes:
        raise InvalidModel(label, f"{where}: length {length} but dims {list(tensor.dims)} need {nbytes} bytes")
    if offset + nbytes > st.st_size:
        raise InvalidModel(
            label,
            f"{where}: bytes {offset}..{offset + nbytes} (dims {list(tensor.dims)}) run past the end of "
            f"{location!r} ({st.st_size} bytes)",
        )
    return ExternalRef(tensor.name, location, Path(target), offset, nbytes)


def _int_entry(entries: dict[str, str], key: str, default: int | None, where: str, label: str) -> int | None:
    if key not in entries:
        return default
    value = entries[key]
    if not re.fullmatch(r"[0-9]{1,20}", value):
        raise InvalidModel(label, f"{where}: {key} {value!r} is not a non-negative integer")
    return int(value)


def _inline_external(proto: onnx.ModelProto, refs: tuple[ExternalRef, ...], label: str) -> None:
    # refs and tensors come from the same walk in the same order: pair them up again
    ref_iter = iter(refs)
    handles: dict[Path, Any] = {}
    try:
        for tensor in _tensors(proto):
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            ref = next(ref_iter)
            f = handles.get(ref.path)
            if f is None:
                f = handles[ref.path] = open(ref.path, "rb")  # closed in finally
            f.seek(ref.offset)
            data = f.read(ref.nbytes)
            if len(data) != ref.nbytes:  # the file shrank since it was checked
                raise InvalidModel(label, f"tensor {ref.tensor!r}: external file {ref.location!r} ended early")
            tensor.raw_data = data
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    except OSError as exc:
        raise InvalidModel(label, f"cannot read external data: {exc.strerror}") from None
    finally:
        for f in handles.values():
            f.close()


# ------------------------------------------------------------------------------------------ opsets
def _check_domains(proto: onnx.ModelProto, label: str) -> None:
    versions = {op.domain or "ai.onnx": op.version for op in proto.opset_import}
    imported = set(versions)
    functions = {(fn.domain, fn.name) for fn in proto.functions}

    def check(nodes, where: str) -> None:
        for node in nodes:
            domain = node.domain or "ai.onnx"
            if domain not in imported and (node.domain, node.op_type) not in functions:
                raise InvalidModel(
                    label,
                    f"{where}node {node.name or node.op_type!r} ({domain}::{node.op_type}) uses domain {domain!r}, "
                    f"which the model does not import (opset_import: {sorted(imported)})",
                )
            if domain == "ai.onnx" and (node.domain, node.op_type) not in functions:
                _check_schema(node, versions["ai.onnx"], where, label)
            for attr in node.attribute:
                for g in [attr.g] if attr.HasField("g") else []:
                    check(g.node, where)
                for g in attr.graphs:
                    check(g.node, where)

    check(proto.graph.node, "")
    for fn in proto.functions:
        fn_imported = imported | {op.domain or "ai.onnx" for op in fn.opset_import}
        saved, imported = imported, fn_imported
        check(fn.node, f"function {fn.name!r}: ")
        imported = saved


def _check_schema(node: onnx.NodeProto, opset: int, where: str, label: str) -> None:
    """The node's op exists in the model's default-domain opset with this many inputs and outputs (a model
    stamped with the wrong opset, or a corrupted op_type, fails here instead of deep in ORT or the optimizer)."""
    name = f"{where}node {node.name or node.op_type!r}"
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        raise InvalidModel(label, f"{name}: op {node.op_type!r} does not exist in ai.onnx opset {opset}") from None
    n_in = len(node.input)
    while n_in and not node.input[n_in - 1]:  # trailing empty names are omitted optional inputs
        n_in -= 1
    if (
        not schema.min_input <= n_in <= schema.max_input
        or not schema.min_output <= len(node.output) <= schema.max_output
    ):
        raise InvalidModel(
            label,
            f"{name}: {node.op_type} in ai.onnx opset {opset} (since version {schema.since_version}) takes "
            f"{schema.min_input}..{schema.max_input} inputs and {schema.min_output}..{schema.max_output} outputs, "
            f"the node has {n_in} and {len(node.output)} (is the model stamped with the wrong opset?)",
        )


def check_ort_version_support(proto: onnx.ModelProto, label: str) -> None:
    """:class:`InvalidModel` when the installed ONNX Runtime cannot load this ``ir_version`` / these opsets."""
    opsets = tuple(sorted((op.domain, op.version) for op in proto.opset_import))
    reason = _ort_refusal(proto.ir_version, opsets)
    if reason:
        shown = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in opsets)
        raise InvalidModel(label, f"ir_version {proto.ir_version}, opsets [{shown}]: {reason}")


@functools.lru_cache(maxsize=64)
def _ort_refusal(ir_version: int, opsets: tuple[tuple[str, int], ...]) -> str:
    """ORT's reason for refusing a model header ('' if it loads): an empty graph with the same header."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    graph = helper.make_graph([], "ortpa_version_probe", [x], [x])
    probe = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    probe.ir_version = ir_version
    options = ort.SessionOptions()
    options.log_severity_level = 3  # the probe's warnings (old opsets) are not the user's business
    try:
        ort.InferenceSession(probe.SerializeToString(), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # ORT's own exception types; the text is the reason
        return f"ONNX Runtime {ort.__version__} cannot load it: {ort_message_line(str(exc))}"
    return ""


def ort_message_line(message: str) -> str:
    """ORT's text without its C++ source location and signature, on one line."""
    text = " ".join(message.split())
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", text)
    # "/onnxruntime_src/.../model.cc:256 onnxruntime::Model::Model(...) Unsupported model IR version: 14, ..."
    match = re.search(r"\.(?:cc|h):\d+ .*?\)\s+(?=[A-Z])", text)
    if match:
        text = text[match.end() :]
    newer = re.search(
        r"Opset (\d+) is under development.*Current official support for domain (\S+) is till opset (\d+)", text
    )
    if newer:
        version, domain, top = newer.groups()
        return f"opset {version} of domain {domain} is newer than it supports (up to {top})"
    return text if len(text) <= 400 else text[:400] + "..."
