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
   regular file inside the model's folder (in a Hugging Face cache snapshot: or in that repository's
   ``blobs/``, every symlink on the way staying inside the repository), with ``offset + size`` inside that
   file; a model given as bytes or
   a ``ModelProto`` has no folder, so its external references are refused when the data is needed (sessions,
   convert) and left alone when it is not (``validate``, ``load_external_data=False``);
4. every string is valid UTF-8; nodes only use domains the model imports (a ``PagedAttention`` without a
   ``com.microsoft`` import), and default-domain ops exist in the model's opset with that many inputs/outputs;
5. ONNX Runtime can load models of this ``ir_version`` and these opset versions (asked of ORT itself on an
   empty graph with the same header, so the answer follows the installed ORT, not a table here).

onnx 1.23's own ``onnx.load`` also refuses absolute, ``..`` and symlinked locations and offsets past the end;
``onnx_ir.load`` refuses escapes but not a length past the end; ORT refuses all of these, but from bytes it
refuses external data outright. We check first, with one message format, then read the data ourselves.

This module holds the entry point, :class:`LoadedModel` and steps 1 and 4's string check; steps 2 and 3 live in
:mod:`ortpa.model.tensors`, the rest of 4 and 5 in :mod:`ortpa.model.opsets` (their public names are
re-exported here).
"""

from __future__ import annotations

import dataclasses
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ortpa.errors import InvalidModel
from ortpa.model.opsets import check_domains, check_ort_version_support, ort_message_line
from ortpa.model.tensors import ExternalRef, check_tensors, inline_external, tensor_nbytes

__all__ = [
    "ExternalRef",
    "LoadedModel",
    "check_ort_version_support",
    "ort_message_line",
    "read_model",
    "tensor_nbytes",
]


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
    refs = check_tensors(proto, label, base_dir, need_data=load_external_data)
    check_domains(proto, label)
    if check_runtime:
        check_ort_version_support(proto, label)
    if refs and load_external_data:
        inline_external(proto, refs, label)
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
