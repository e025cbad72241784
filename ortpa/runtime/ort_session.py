"""ONNX Runtime sessions of models of any size, without a serialized copy of their weights.

``proto.SerializeToString()`` caps a model at protobuf's 2 GB and holds a second copy of every weight while ORT
parses it. :func:`open_ort_session` instead

* opens the file itself when the model is exactly the file on disk (ORT resolves external data, memory-mapped);
* otherwise (a rewritten graph: renamed nodes, the portable lowering) serializes the graph only: every
  initializer of :data:`MIN_EXTERNAL_BYTES` or more becomes an external-data reference that
  ``SessionOptions.add_external_initializers`` overrides with an ``OrtValue`` over the original bytes, a
  read-only ``numpy.memmap`` of the model's own data file, or a view of the proto's ``raw_data``. ORT never
  reads those references, so no temp file is written and nothing is copied into a new serialized model.

The arrays behind the OrtValues must outlive the session: :class:`OrtSession` keeps them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ortpa.model.file import LoadedModel
from ortpa.runtime.ortvalues import numpy_dtype_for_onnx, to_ortvalue

__all__ = [
    "MIN_EXTERNAL_BYTES",
    "ExternalInitializers",
    "OrtSession",
    "copy_without_initializers",
    "external_initializers",
    "open_ort_session",
]

# initializers below this stay in the serialized graph: shapes and small constants that ORT may fold at load
MIN_EXTERNAL_BYTES = 1024
# a location no file has: ORT only reaches it if add_external_initializers missed a tensor (a bug, said plainly)
_PLACEHOLDER = "__ortpa_external_initializer__"


@dataclass
class OrtSession:
    """An ``ort.InferenceSession`` and the arrays its external initializers point into."""

    session: ort.InferenceSession
    keep_alive: list[Any] = field(default_factory=list)
    from_path: bool = False


def _fresh_options(user: ort.SessionOptions | None) -> ort.SessionOptions:
    """A new SessionOptions with the caller's settings: add_external_initializers registers names on the
    object itself, and ORT refuses a name the next model lacks, so a caller's options are never reused.
    Settable properties are copied; session config entries cannot be enumerated: those of
    :data:`_COPIED_CONFIG_KEYS` are copied when set."""
    options = ort.SessionOptions()
    if user is not None:
        for name in dir(ort.SessionOptions):
            attr = getattr(ort.SessionOptions, name)
            if isinstance(attr, property) and attr.fset is not None:
                setattr(options, name, getattr(user, name))
        for key in _COPIED_CONFIG_KEYS:
            try:
                value = user.get_session_config_entry(key)
            except RuntimeError:  # not set
                continue
            options.add_session_config_entry(key, value)
    return options


# config entries a caller's options keep through _fresh_options (conversion's verification turns prepacking off
# so the weights stay memory-mapped instead of copied per MatMul, and its float32 twins turn constant folding
# off so their casts of half weights are not folded into float32 copies: ortpa.parity.upcast)
_COPIED_CONFIG_KEYS = (
    "session.disable_prepacking",
    "session.intra_op.allow_spinning",
    "optimization.disable_specified_optimizers",
)


def _numpy_dtype(elem_type: int) -> np.dtype:
    return np.dtype(numpy_dtype_for_onnx(elem_type))


@dataclass(frozen=True)
class ExternalInitializers:
    """The initializers :func:`external_initializers` took out of the graph, read only when a session needs
    them (a model opened from its own file never does)."""

    base_dir: Path | None
    tensors: tuple[onnx.TensorProto, ...]

    def arrays(self, skip: frozenset[str] = frozenset()) -> tuple[list[str], list[np.ndarray]]:
        """(names, arrays) of the tensors not in ``skip``: external data memory-mapped read-only, inline data as
        arrays over ``raw_data``."""
        tensors = [t for t in self.tensors if t.name not in skip]
        return [t.name for t in tensors], [_array_of(t, self.base_dir) for t in tensors]


def external_initializers(
    proto: onnx.ModelProto, base_dir: Path | None, min_bytes: int = MIN_EXTERNAL_BYTES
) -> tuple[onnx.ModelProto, ExternalInitializers]:
    """A graph-only copy of ``proto`` (initializers of ``min_bytes`` or more become placeholder external
    references) and the tensors they stand for. ``proto`` is not modified; no weight is read here."""
    taken: list[onnx.TensorProto] = []
    kept: list[onnx.TensorProto] = []
    for init in proto.graph.initializer:
        nbytes = _nbytes(init, base_dir)
        if nbytes is None or nbytes < min_bytes:
            kept.append(init)
            continue
        stub = onnx.TensorProto()
        stub.name, stub.data_type = init.name, init.data_type
        stub.dims.extend(init.dims)
        stub.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", _PLACEHOLDER), ("offset", "0"), ("length", str(nbytes))):
            entry = stub.external_data.add()
            entry.key, entry.value = key, value
        kept.append(stub)
        taken.append(init)
    out = copy_without_initializers(proto)
    out.graph.initializer.extend(kept)
    return out, ExternalInitializers(base_dir, tuple(taken))


def copy_without_initializers(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``proto`` with an empty initializer list, made without copying the initializers' bytes."""
    graph = _copy_fields(proto.graph, onnx.GraphProto(), skip="initializer")
    out = _copy_fields(proto, onnx.ModelProto(), skip="graph")
    out.graph.CopyFrom(graph)
    return out


def _copy_fields(src: Any, dst: Any, skip: str) -> Any:
    for fd, value in src.ListFields():
        if fd.name == skip:
            continue
        if fd.is_repeated:
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)
    return dst


def _nbytes(init: onnx.TensorProto, base_dir: Path | None) -> int | None:
    """Bytes of a tensor that can be handed to ORT as an array; None for those that stay in the graph."""
    if init.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    try:
        dtype = _numpy_dtype(init.data_type)
    except TypeError:
        return None  # int4 and friends: left to ORT in the graph
    count = 1
    for d in init.dims:
        count *= int(d)
    nbytes = count * dtype.itemsize
    if init.data_location == onnx.TensorProto.EXTERNAL:
        return nbytes if base_dir is not None else None
    if init.HasField("raw_data"):
        return nbytes
    return None  # typed fields (float_data, ...): rare for weights, kept in the graph


def _array_of(init: onnx.TensorProto, base_dir: Path | None) -> np.ndarray:
    dtype = _numpy_dtype(init.data_type)
    shape = tuple(int(d) for d in init.dims)
    if init.data_location == onnx.TensorProto.EXTERNAL:
        assert base_dir is not None  # _nbytes keeps external tensors without a folder in the graph
        entries = {e.key: e.value for e in init.external_data}
        path = Path(base_dir) / entries["location"]  # checked by read_model: inside the folder, within the file
        return np.memmap(path, dtype=dtype, mode="r", offset=int(entries.get("offset", 0)), shape=shape)
    return np.frombuffer(init.raw_data, dtype=dtype).reshape(shape)


_EXTERNAL_FOLDER_KEY = "session.model_external_initializers_file_folder_path"


def _point_at_data_files(graph_only: onnx.ModelProto, external: ExternalInitializers) -> frozenset[str]:
    """Give the placeholders of tensors stored in the model's own external data files their real locations back
    (in place, in the graph ORT will parse); their names. ORT then maps them from the folder given by
    :data:`_EXTERNAL_FOLDER_KEY` as it does for a file it opens itself; handed over as OrtValues instead, it keeps
    a private copy of some (measured: ~one embedding table more than opening the file)."""
    if external.base_dir is None:
        return frozenset()
    folder = Path(external.base_dir).resolve()

    def inside(tensor: onnx.TensorProto) -> bool:
        # ORT refuses data whose real path leaves the folder (a Hugging Face cache snapshot links into blobs/):
        # those stay OrtValues over ortpa's own checked memory map
        location = {e.key: e.value for e in tensor.external_data}.get("location", "")
        return (folder / location).resolve().is_relative_to(folder)

    stored = {t.name: t for t in external.tensors if t.data_location == onnx.TensorProto.EXTERNAL and inside(t)}
    done = set()
    for init in graph_only.graph.initializer:
        original = stored.get(init.name)
        if original is None or init.data_location != onnx.TensorProto.EXTERNAL:
            continue
        if {e.key: e.value for e in init.external_data}.get("location") != _PLACEHOLDER:
            continue
        del init.external_data[:]
        init.external_data.extend(original.external_data)
        done.add(init.name)
    return frozenset(done)


def open_ort_session(
    loaded: LoadedModel,
    graph_only: onnx.ModelProto,
    external: ExternalInitializers,
    *,
    unchanged: bool,
    sess_options: ort.SessionOptions | None = None,
    providers: Sequence[Any] | None = None,
    provider_options: Sequence[dict] | None = None,
    custom_ops_library: str | None = None,
    **kwargs: Any,
) -> OrtSession:
    """An ORT session of ``graph_only`` (from :func:`external_initializers` of ``loaded``, possibly rewritten
    since): from the file itself when ``unchanged`` and ``loaded`` came from a path, else from the graph with
    ``external``'s arrays passed as external initializers. ``custom_ops_library`` is registered with a copy of
    the options (the caller's stay as they are)."""
    if custom_ops_library is not None:
        sess_options = _fresh_options(sess_options)
        sess_options.register_custom_ops_library(custom_ops_library)
    if unchanged and loaded.base_dir is not None and os.path.isfile(loaded.label):
        sess = ort.InferenceSession(
            loaded.label, sess_options, providers=providers, provider_options=provider_options, **kwargs
        )
        return OrtSession(sess, from_path=True)
    on_disk = _point_at_data_files(graph_only, external)
    names, arrays = external.arrays(skip=on_disk)
    # a copy made above for the library is fresh already: registering twice would be refused
    fresh = custom_ops_library is None and (names or on_disk)
    options = _fresh_options(sess_options) if fresh else sess_options
    if on_disk:
        # ORT reads (memory-maps) these from the model's own data files, exactly as it would open the file
        options.add_session_config_entry(_EXTERNAL_FOLDER_KEY, str(external.base_dir))
    values = [to_ortvalue(a) for a in arrays]
    if names:
        options.add_external_initializers(names, values)
    sess = ort.InferenceSession(
        graph_only.SerializeToString(), options, providers=providers, provider_options=provider_options, **kwargs
    )
    return OrtSession(sess, keep_alive=[arrays, values])
