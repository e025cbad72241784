"""Tensor and external-data checks of :func:`ortpa.model.file.read_model` (its steps 2 and 3).

Every tensor of a model (initializers, sparse initializers, ``Constant``-style attributes, subgraphs,
functions) declares a known element type, non-negative dims, a byte size that does not overflow int64, and
inline ``raw_data`` of exactly that size; sizes are Python ints and nothing of that size is allocated. Every
external-data reference is a relative ``location`` without ``..`` that resolves (symlinks included) to a
regular file inside the model's folder (or, for a model in a Hugging Face cache snapshot, in that repository's
``blobs/``: :func:`resolve_contained`), with ``offset + size`` inside that file; :func:`inline_external` then
reads the checked bytes into the proto.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx

from ortpa.dtypes import bits
from ortpa.errors import InvalidModel

__all__ = ["ExternalRef", "check_tensors", "hf_cache_repo", "inline_external", "resolve_contained", "tensor_nbytes"]

# bytes past which a declared tensor is refused outright: int64 byte counts overflow beyond it in ORT and numpy
_MAX_TENSOR_BYTES = 2**62


def _bits(data_type: int) -> int | None:
    """Bits per element of a fixed-size ONNX element type (:func:`ortpa.dtypes.bits`); None for STRING / unknown."""
    if data_type == onnx.TensorProto.STRING:
        return None
    try:
        n = bits(data_type)
    except (TypeError, ValueError):
        return None
    return n if n > 0 else None


@dataclass(frozen=True)
class ExternalRef:
    """One validated external-data reference: ``nbytes`` bytes at ``offset`` of ``path`` (inside the folder)."""

    tensor: str
    location: str
    path: Path
    offset: int
    nbytes: int


# ------------------------------------------------------------------------------------------ tensors
def tensor_nbytes(tensor: onnx.TensorProto, label: str) -> int | None:
    """Declared byte size of ``tensor`` from dims and element type (``None`` for strings), checked."""
    where = f"tensor {tensor.name!r}"
    if _bits(tensor.data_type) is None and tensor.data_type != onnx.TensorProto.STRING:
        raise InvalidModel(label, f"{where}: unknown element type {tensor.data_type}")
    count = 1
    for d in tensor.dims:
        if d < 0:
            raise InvalidModel(label, f"{where}: negative dimension {d} in dims {list(tensor.dims)}")
        count *= d  # a Python int: no overflow, and nothing of this size is allocated
    if tensor.data_type == onnx.TensorProto.STRING:
        return None
    nbytes = (count * (_bits(tensor.data_type) or 0) + 7) // 8
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


def check_tensors(
    proto: onnx.ModelProto, label: str, base_dir: Path | None, need_data: bool
) -> tuple[ExternalRef, ...]:
    """Check every tensor's declared size and inline bytes, and every external reference (unless there is no
    folder and ``need_data`` is false); the checked references, in walk order (:func:`inline_external` relies
    on it)."""
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
    target, escape = resolve_contained(folder, location)
    if escape is not None:
        raise InvalidModel(label, f"{where} location {location!r} {escape}")
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


def hf_cache_repo(folder: str) -> str | None:
    """The Hugging Face cache repository (``.../models--ORG--NAME``, holding ``snapshots/`` and ``blobs/``) whose
    snapshot ``folder`` (a real path) lies in, or ``None``."""
    parts = Path(folder).parts
    for i in range(len(parts) - 3, 0, -1):  # models--X / snapshots / REV [/ sub...]: the innermost match
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            repo = os.path.join(*parts[: i + 1])
            if os.path.isdir(os.path.join(repo, "blobs")):
                return repo
    return None


def _inside(root: str, path: str) -> bool:
    path = os.path.normpath(path)
    return os.path.commonpath([root, path]) == root


def resolve_contained(folder: str, location: str) -> tuple[str, str | None]:
    """Where ``location`` (relative, no ``..``) under the real ``folder`` leads, and ``None`` when ortpa may read
    it, else why not (one line, for an error message).

    Allowed (docs/reliability.md, "Hostile model files"): a target inside ``folder``; or, when ``folder`` is in
    a Hugging Face cache snapshot, a file in that repository's ``blobs/`` reached by symlinks that each stay
    inside the repository.
    """
    target = os.path.realpath(os.path.join(folder, location))  # resolves every symlink on the way
    if _inside(folder, target):
        return target, None
    outside = f"resolves to {target}, outside the model's folder {folder}"
    repo = hf_cache_repo(folder)
    if repo is None:
        return target, outside
    # follow the chain link by link: every hop must stay in this repository, the last one in its blobs/
    path = os.path.join(folder, location)
    for _ in range(40):  # the kernel's own limit on nested symlinks
        parent = os.path.realpath(os.path.dirname(path))
        path = os.path.join(parent, os.path.basename(path))
        if not _inside(repo, path):
            return target, f"leads through {os.path.normpath(path)}, outside its Hugging Face cache repository {repo}"
        if not os.path.islink(path):
            break
        path = os.path.join(parent, os.readlink(path))  # a relative link is relative to its own folder
    else:
        return target, f"is a symlink loop in {repo}"
    blobs = os.path.join(repo, "blobs")
    if not _inside(blobs, path):
        return target, f"{outside} and outside its Hugging Face cache repository's {blobs}"
    return target, None


def _int_entry(entries: dict[str, str], key: str, default: int | None, where: str, label: str) -> int | None:
    if key not in entries:
        return default
    value = entries[key]
    if not re.fullmatch(r"[0-9]{1,20}", value):
        raise InvalidModel(label, f"{where}: {key} {value!r} is not a non-negative integer")
    return int(value)


def inline_external(proto: onnx.ModelProto, refs: tuple[ExternalRef, ...], label: str) -> None:
    """Read each checked reference's bytes into its tensor's ``raw_data``; the proto then has no external data."""
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
