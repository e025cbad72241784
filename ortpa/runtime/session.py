"""Sessions that run PagedAttention models on any execution provider.

* :class:`InferenceSession` is a drop-in for ``onnxruntime.InferenceSession``: each PagedAttention node runs
  natively where the first provider has a kernel for it (CUDA, WebGPU; on CPU ortpa's own native library,
  ``ortpa.ops.native``) and is otherwise rewritten, in memory, to ``ortpa.ops.portable`` (standard ONNX ops).
  Every node is validated and gated before any ORT session exists, so an unsupported mode fails with a typed
  error, not deep inside ONNX Runtime.
* :class:`PagedSession` owns each layer's KV caches as ``OrtValue`` s on the provider's device and binds a
  cache input and its aliasing output (``key_cache`` / ``key_cache_out``) to the *same* ``OrtValue`` on
  every step, so the caches are updated in place: no per-step copy of the pool.

One module for both classes (~460 lines): :class:`PagedSession` is an :class:`InferenceSession` whose cache
binding needs the same validation, gating and lowering state; splitting them would export that state.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ortpa.errors import InvalidArgument, InvalidModel, InvalidParameter, KVPoolTooLarge, NotImplementedByBackend
from ortpa.model.file import LoadedModel, ort_message_line, read_model
from ortpa.model.ref import resolve_any
from ortpa.ops.backends import backend_for_provider
from ortpa.ops.native import NATIVE_BACKEND, absent_reason, native_library, paged_attention_mode, warn_if_absent
from ortpa.ops.portable.calls import lowered_cache_ports
from ortpa.ops.shape_inference import infer_shapes
from ortpa.ops.spec import DOMAIN, OP_TYPE
from ortpa.providers import CPU, DEVICE_OF
from ortpa.runtime.device import best_providers
from ortpa.runtime.ort_session import external_initializers, open_ort_session
from ortpa.runtime.ortvalues import numpy_dtype_for_onnx, ortvalue_to_numpy, to_ortvalue

__all__ = [
    "CacheAlias",
    "InferenceSession",
    "PagedSession",
    "find_cache_aliases",
    "load_model",
    "read_for_session",
]


def load_model(model: str | os.PathLike | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """Read a model from a path, bytes or a ModelProto (copied), with a clear error for bad files.

    External data is read into the copy (checked first: inside the model's folder, within the file); see
    :func:`ortpa.model.file.read_model`.
    """
    return read_model(model).proto


def _provider_names(providers: Sequence[Any] | None) -> list[str]:
    if not providers:
        return best_providers()
    return [p[0] if isinstance(p, tuple) else p for p in providers]


def _paged_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == OP_TYPE and n.domain == DOMAIN]


def _name_nodes(model: onnx.ModelProto) -> bool:
    """Give every PagedAttention node a unique name: diagnostics and per-node decisions need one.
    True when a name changed (the graph then differs from the file)."""
    seen: set[str] = set()
    changed = False
    for i, node in enumerate(_paged_nodes(model)):
        if not node.name or node.name in seen:
            node.name = f"PagedAttention_{i}"
            changed = True
        seen.add(node.name)
    return changed


@dataclass(frozen=True)
class CacheAlias:
    """A cache graph input and the graph output that must share its buffer."""

    input_name: str
    output_name: str | None  # None when the node does not expose the cache output
    node: str


def find_cache_aliases(model: onnx.ModelProto) -> list[CacheAlias]:
    """Cache inputs of PagedAttention nodes that are graph inputs, with their aliasing graph outputs."""
    graph_inputs = {i.name for i in model.graph.input}
    graph_outputs = {o.name for o in model.graph.output}
    aliases = []
    for node in _paged_nodes(model):
        for in_idx, out_idx in ((3, 1), (4, 2)):
            if len(node.input) <= in_idx or node.input[in_idx] not in graph_inputs:
                continue
            out = node.output[out_idx] if len(node.output) > out_idx and node.output[out_idx] else None
            out = _through_trailing_write(model, out, graph_outputs)
            aliases.append(CacheAlias(node.input[in_idx], out if out in graph_outputs else None, node.name))
    # a file lowered to portable function calls (`ortpa convert --portable`): the same caches, found by name
    for port in lowered_cache_ports(model):
        if port.input_name in graph_inputs:
            out = port.output_name if port.output_name in graph_outputs else None
            aliases.append(CacheAlias(port.input_name, out, port.node))
    return aliases


def _through_trailing_write(model: onnx.ModelProto, name: str | None, graph_outputs: set[str]) -> str | None:
    """A cache output that one ``ScatterND`` (rows the graph writes itself: the expanded MLA prefill's) extends
    before it becomes the graph output: that output shares the cache's buffer."""
    if name is None or name in graph_outputs:
        return name
    users = [n for n in model.graph.node if name in n.input]
    if len(users) == 1 and users[0].op_type == "ScatterND" and users[0].input[0] == name:
        return users[0].output[0]
    return name


def _native_backend(label: str, provider: str | None, mode: str, block_size: int | None = None) -> str | None:
    """The backend that runs PagedAttention natively under ``provider`` in ``mode`` (None: none does).

    The provider's own kernel (CUDA, WebGPU) where it has one; on the CPU provider ortpa's native library where
    it is present (absent: said once per process, see :func:`ortpa.ops.native.warn_if_absent`) and the caches'
    ``block_size`` keeps the op's rule 1.5.2 (a power of two, at least 16), which the native kernel checks on
    every call as ONNX Runtime's kernels do; the portable lowering takes any block size."""
    if provider is None or mode == "portable":
        return None
    backend = backend_for_provider(provider)
    if backend is not None or provider != CPU:
        return backend
    if native_library() is None:
        if mode == "native":
            raise InvalidParameter(
                label, "paged_attention", "'native' only where ortpa's native library is present", absent_reason()
            )
        warn_if_absent()
        return None
    if block_size is not None and (block_size < 16 or block_size & (block_size - 1)):
        if mode == "native":
            raise InvalidParameter(
                label, "block_size", "a power of two, at least 16 (rule 1.5.2) for the native kernel", block_size
            )
        return None
    return NATIVE_BACKEND


def _plan_nodes(
    loaded: LoadedModel, providers: list[str], mode: str = "auto", block_size: int | None = None
) -> tuple[list[str], list[str], str]:
    """Validate every node once; return (native node names, portable node names, the native backend's name).
    Raises before any session.

    A node runs natively when the first provider has a PagedAttention kernel (ortpa's native library on CPU)
    whose gate accepts it; any other node (no kernel, or a mode the kernel lacks) goes to the portable
    implementation, whose own gate must accept it or :class:`~ortpa.errors.NotImplementedByBackend` is raised.
    ``mode`` (:func:`ortpa.ops.native.paged_attention_mode`) forces one path: ``portable`` lowers every node,
    ``native`` refuses a node the native backend cannot run. ``loaded.proto`` is the model with shapes inferred
    already: one shape inference and one check of each node's rules per session.
    """
    from ortpa.ops.validate.model import validate_backends

    if not _paged_nodes(loaded.proto):
        return [], [], ""
    native_backend = _native_backend(loaded.label, providers[0] if providers else None, mode, block_size)
    reports = validate_backends(loaded, [b for b in (native_backend, "portable") if b], shapes_inferred=True)
    report = reports[None]
    if not report.ok:
        raise _report_error(report)
    names = [n.node for n in report.nodes]
    native: list[str] = []
    if native_backend is not None:
        gated = reports[native_backend]
        native = [n.node for n in gated.nodes if n.status in ("valid", "unchecked")]
        if mode == "native" and len(native) < len(names):
            raise _report_error(gated, next(name for name in names if name not in native))
    portable = [name for name in names if name not in native]
    if portable:
        gated = reports["portable"]
        failing = [n for n in gated.nodes if n.node in portable and n.status not in ("valid", "unchecked")]
        if failing:
            raise _report_error(gated, failing[0].node)
    return native, portable, native_backend or ""


def read_for_session(model: Any) -> LoadedModel:
    """Read and check ``model`` for a session: a file's external data stays on disk (checked, not read), to be
    memory-mapped by ONNX Runtime; bytes and ModelProtos are read as before (external data needs a folder)."""
    if isinstance(model, LoadedModel):
        return model
    model = resolve_any(model)  # a folder or a cached Hugging Face repo id: its ONNX file
    if isinstance(model, (str, os.PathLike)):
        return read_model(model, load_external_data=False)
    return read_model(model)


def _report_error(report: Any, name: str | None = None) -> Exception:
    """The first problem of a validation report as the typed error a direct call would have raised."""
    for node_report in report.nodes:
        if name is not None and node_report.node != name:
            continue
        for rule, input_name, message in node_report.errors:
            return InvalidArgument(rule, input_name, message, node=node_report.node)
        for backend, feature, detail in node_report.backend_errors:
            return NotImplementedByBackend(backend, feature, detail, node=node_report.node)
    return InvalidArgument("model", name or "model", report.format())


class InferenceSession:
    """Drop-in for ``onnxruntime.InferenceSession`` that runs PagedAttention on every provider.

    >>> import ortpa  # doctest: +SKIP
    >>> sess = ortpa.InferenceSession("paged.onnx", providers=["CPUExecutionProvider"])  # doctest: +SKIP
    >>> logits, *present = sess.run(None, feeds)  # doctest: +SKIP

    Inputs may be numpy arrays of any dtype ortpa uses (bfloat16 and float8 via ml_dtypes included) or
    OrtValues. With plain :meth:`run`, cache outputs come back as new arrays; use :class:`PagedSession` (or
    :meth:`io_binding` with the same OrtValue bound to a cache input and its output) to update in place.

    ``paged_attention`` (else ``$ORTPA_PAGED_ATTENTION``; default ``auto``) picks the path: ``auto`` runs a node
    natively where the provider's backend accepts it and portably elsewhere, ``portable`` lowers every node,
    ``native`` refuses a node no native backend runs. :attr:`implementations` says, per node, which ran
    (``native-cpu``, ``cuda``, ``webgpu`` or ``portable``). ``block_size``: the caches' block size where the
    caller knows it before any run (:class:`PagedSession`), so that the path is chosen for it.

    :meth:`run` is safe to call from several threads at once, as ONNX Runtime's own ``run`` is: the wrapper
    keeps no per-call state (each bound run makes its own IO binding and copies of aliased caches).
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto | LoadedModel,
        sess_options: ort.SessionOptions | None = None,
        providers: Sequence[Any] | None = None,
        provider_options: Sequence[dict] | None = None,
        *,
        paged_attention: str | None = None,
        block_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        loaded = read_for_session(model)
        self.label = loaded.label
        mode = paged_attention_mode(paged_attention)
        # the graph with its weights as references (memory-mapped or views): every step below is weight-free
        graph_only, external = external_initializers(loaded.proto, loaded.base_dir)
        renamed = _name_nodes(graph_only)
        self._providers_requested = list(providers) if providers else _provider_names(None)
        names = _provider_names(self._providers_requested)
        inferred = infer_shapes(graph_only) if _paged_nodes(graph_only) else graph_only  # once per session
        self.native_nodes, self.portable_nodes, native_backend = _plan_nodes(
            dataclasses.replace(loaded, proto=inferred), names, mode, block_size
        )
        # which implementation runs each PagedAttention node: "native-cpu", "cuda", "webgpu" or "portable"
        self.implementations: dict[str, str] = {
            **{name: native_backend for name in self.native_nodes},
            **{name: "portable" for name in self.portable_nodes},
        }
        library = native_library() if native_backend == NATIVE_BACKEND and self.native_nodes else None
        # found on the op nodes, before the portable lowering replaces them by function calls
        self.aliases = find_cache_aliases(graph_only)
        if self.portable_nodes:
            from ortpa.ops.portable import lower_to_portable, value_types

            graph_only = lower_to_portable(graph_only, self.portable_nodes, types=value_types(inferred))
        reordered = False
        if self.native_nodes and any(n.op_type == "ScatterND" for n in graph_only.graph.node):
            from ortpa.ops.trailing_write import write_before_native

            before = graph_only
            graph_only = write_before_native(graph_only, self.native_nodes)  # the expanded MLA prefill's rows
            reordered = graph_only.graph != before.graph
        self.model = graph_only
        self._native_aliases = [a for a in self.aliases if a.node in self.native_nodes and a.output_name]
        self._device = DEVICE_OF.get(names[0], "cpu")
        try:
            opened = open_ort_session(
                loaded,
                graph_only,
                external,
                unchanged=not renamed and not self.portable_nodes and not reordered,
                sess_options=sess_options,
                providers=self._providers_requested,
                provider_options=provider_options,
                custom_ops_library=str(library.path) if library is not None else None,
                **kwargs,
            )
        except Exception as exc:
            # ONNX Runtime's own errors (Fail, InvalidGraph, ...) on a model that passed our checks: name the
            # file. Anything else (an unknown provider name is a ValueError) is the caller's and passes through.
            if not type(exc).__module__.startswith("onnxruntime."):
                raise
            raise InvalidModel(self.label, f"ONNX Runtime rejected it: {ort_message_line(str(exc))}") from None
        self._sess = opened.session
        self._keep_alive = opened.keep_alive  # the arrays behind the external initializers
        self._output_types = {o.name: o.type for o in self._sess.get_outputs()}

    # -- the onnxruntime.InferenceSession surface ---------------------------------------------------------
    def run(self, output_names: Sequence[str] | None, input_feed: Mapping[str, Any], run_options=None) -> list:
        names = list(output_names) if output_names else [o.name for o in self._sess.get_outputs()]
        needs_binding = (
            self._native_aliases
            or any(_is_raw_dtype(v) for v in input_feed.values())
            or any(_is_raw_type_str(self._output_types[n]) for n in names)
        )
        if not needs_binding:
            return self._sess.run(names, dict(input_feed), run_options)
        return self._run_bound(names, input_feed, run_options)

    def _run_bound(self, names: list[str], input_feed: Mapping[str, Any], run_options) -> list:
        """Run through IO binding: ml_dtypes inputs/outputs, and native kernels that demand aliased caches."""
        io = self._sess.io_binding()
        owned: dict[str, Any] = {}  # keeps the arrays behind the OrtValues alive until the run is over
        alias_of = {a.output_name: a.input_name for a in self._native_aliases}
        for name, value in input_feed.items():
            if isinstance(value, ort.OrtValue):
                ov = value
            else:
                arr = np.ascontiguousarray(value)
                if name in alias_of.values():
                    arr = arr.copy()  # the kernel writes in place; the caller's array stays untouched
                owned[name] = arr
                ov = to_ortvalue(arr, self._device)
            owned[name + "#ov"] = ov
            io.bind_ortvalue_input(name, ov)
        for name in names:
            if name in alias_of:
                io.bind_ortvalue_output(name, owned[alias_of[name] + "#ov"])
            else:
                io.bind_output(name, "cpu")
        self._sess.run_with_iobinding(io, run_options)
        results = []
        bound = dict(zip(names, io.get_outputs(), strict=True))
        for name in names:
            results.append(ortvalue_to_numpy(bound[name]))
        return results

    def run_with_iobinding(self, iobinding, run_options=None) -> None:
        return self._sess.run_with_iobinding(iobinding, run_options)

    def io_binding(self):
        return self._sess.io_binding()

    def get_inputs(self):
        return self._sess.get_inputs()

    def get_outputs(self):
        return self._sess.get_outputs()

    def get_providers(self) -> list[str]:
        return self._sess.get_providers()

    def __getattr__(self, name: str) -> Any:  # the rest of ORT's surface (get_modelmeta, end_profiling, ...)
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._sess, name)


def _is_raw_dtype(value: Any) -> bool:
    dtype = getattr(value, "dtype", None)
    return dtype is not None and np.dtype(dtype).kind == "V"


def _is_raw_type_str(type_str: str) -> bool:
    return type_str in ("tensor(bfloat16)", "tensor(float8e4m3fn)")


class PagedSession:
    """A session whose KV caches live in ``OrtValue`` s it owns and are updated in place on every step.

    ``dims`` fills symbolic dimensions of the cache inputs (typically ``num_blocks`` and ``block_size``).
    Each cache input is bound with ``bind_ortvalue_input`` and its aliasing output with
    ``bind_ortvalue_output`` to the same OrtValue, which is the CUDA kernel's contract and lets the portable
    op's in-place ``ScatterND`` skip its copy. :meth:`data_ptrs` exposes the buffers' addresses so callers
    (and tests) can check that they never move.

    Thread safety: the caches are one mutable buffer, so :meth:`run`, :meth:`copy_blocks`,
    :meth:`write_cache` and :meth:`cache` take one lock: calls from several threads are safe and run one
    at a time (a step must never see another step's half-written cache or a block copy in flight).
    """

    def __init__(
        self,
        model: str | os.PathLike | bytes | onnx.ModelProto | LoadedModel,
        *,
        num_blocks: int,
        block_size: int | None = None,
        providers: Sequence[Any] | None = None,
        sess_options: ort.SessionOptions | None = None,
        dims: Mapping[str, int] | None = None,
        paged_attention: str | None = None,
    ) -> None:
        self.session = InferenceSession(
            model, sess_options, providers=providers, paged_attention=paged_attention, block_size=block_size
        )
        self.device = self.session._device
        self.num_blocks = int(num_blocks)
        self.aliases = self.session.aliases
        if not self.aliases:
            raise InvalidModel(self.session.label, "no PagedAttention cache input is a graph input; nothing to page")
        declared = {i.name: i for i in self.session.model.graph.input}
        layout: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for alias in self.aliases:
            vi = declared[alias.input_name]
            shape = _concrete_shape(vi, alias.input_name, num_blocks, block_size, dims or {})
            layout[alias.input_name] = (shape, np.dtype(numpy_dtype_for_onnx(vi.type.tensor_type.elem_type)))
        _check_pool_fits(self.session.label, self.device, layout)
        self._arrays: dict[str, np.ndarray] = {}
        self._values: dict[str, ort.OrtValue] = {}
        for alias in self.aliases:
            shape, dtype = layout[alias.input_name]
            arr = np.zeros(shape, dtype=dtype)
            if self.device == "cpu":
                # written now, so that every page of the pool is resident before the first step: np.zeros maps
                # untouched pages, and a step's first write into one faulted inside ONNX Runtime's run (calls of
                # the attention node of ~40 us took 6 ms now and then, docs/native.md "The driver loop")
                arr.fill(0)
            self._arrays[alias.input_name] = arr
            self._values[alias.input_name] = to_ortvalue(arr, self.device)
        first = self._arrays[self.aliases[0].input_name]
        self.block_size = int(first.shape[1])
        self._outputs = [o.name for o in self.session.get_outputs()]
        self._cache_outputs = {a.output_name: a.input_name for a in self.aliases if a.output_name}
        # each step input's declared dims, so that a feed of the wrong rank is refused in ortpa's words
        self._declared = {i.name: tuple(i.shape) for i in self.session.get_inputs() if i.shape is not None}
        self._declared_outputs = {o.name: o for o in self.session.model.graph.output}
        self._lock = threading.Lock()  # serializes every use of the cache buffers (see the class docstring)
        self._io: ort.IOBinding | None = None  # made on the first run (see _binding)
        self._io_key: tuple = ()  # (fetched outputs, fed inputs) self._io was made for
        self._step_binding: tuple | None = None  # (binding, fetched outputs, bound arrays) of bind_step

    @property
    def cache_names(self) -> list[str]:
        return [a.input_name for a in self.aliases]

    def cache(self, name: str) -> np.ndarray:
        """A copy of one cache's current contents."""
        with self._lock:
            if self.device == "cpu":
                return self._arrays[name].copy()
            from ortpa.runtime.cuda_memory import device_to_host

            return device_to_host(self._values[name], self._arrays[name].dtype)

    def data_ptrs(self) -> dict[str, int]:
        return {name: value.data_ptr() for name, value in self._values.items()}

    def write_cache(self, name: str, array: np.ndarray) -> None:
        """Overwrite one cache's contents in place (same buffer), e.g. to seed a test state."""
        target = self._arrays[name]
        if array.shape != target.shape or np.dtype(array.dtype) != target.dtype:
            raise ValueError(f"cache {name!r}: expected {target.shape} {target.dtype}, got {array.shape} {array.dtype}")
        with self._lock:
            target[...] = array
            if self.device != "cpu":
                self._values[name].update_inplace(np.ascontiguousarray(array).view(_raw(array.dtype)))

    def copy_blocks(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every cache (copy-on-write of forked sequences)."""
        pairs = list(pairs)
        if not pairs:
            return
        with self._lock:
            if self.device == "cpu":
                src = np.array([s for s, _ in pairs])
                dst = np.array([d for _, d in pairs])
                for arr in self._arrays.values():
                    arr[dst] = arr[src]
                return
            from ortpa.runtime.cuda_memory import copy_device_blocks

            for value in self._values.values():
                copy_device_blocks(value, pairs)

    def run(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """One step: bind the step's inputs and the aliased caches, run, return the non-cache outputs."""
        with self._lock:
            return self._run(feeds, output_names)

    def _run(self, feeds: Mapping[str, Any], output_names: Sequence[str] | None) -> dict[str, np.ndarray]:
        sess = self.session._sess
        wanted = list(output_names) if output_names else [n for n in self._outputs if n not in self._cache_outputs]
        fetched = [n for n in wanted if n not in self._cache_outputs]
        io = self._binding(fetched, list(feeds))
        keep = []
        for name, value in feeds.items():
            if name in self._values:
                raise ValueError(f"{name!r} is a cache owned by this PagedSession; do not feed it")
            self._check_rank(name, value)
            # (each bind replaces the previous step's binding of that name)
            if isinstance(value, np.ndarray) and value.dtype.kind in "biuf" and value.flags.c_contiguous:
                keep.append(value)
                io.bind_cpu_input(name, value)  # a plain numpy array: no Python OrtValue (~5x less host work)
                continue
            ov = value if isinstance(value, ort.OrtValue) else to_ortvalue(np.ascontiguousarray(value), "cpu")
            keep.append(ov)
            io.bind_ortvalue_input(name, ov)
        for name in fetched:
            io.bind_output(name, "cpu")  # a fresh, unallocated output: its shape changes from step to step
        sess.run_with_iobinding(io)
        return self._fetched(io, fetched)

    def step_output(self, name: str, rows: int) -> np.ndarray | None:
        """A host array for output ``name`` of a step with ``rows`` rows, to pass to :meth:`bind_step` as
        ``into``: when the model declares the output ``[rows, d, ...]`` with every ``d`` a value and a float32 /
        float16 type, and the session runs on the CPU; None otherwise (the output is then fetched as ONNX Runtime
        allocates it)."""
        vi = self._declared_outputs.get(name)
        if vi is None or self.device != "cpu" or not vi.type.HasField("tensor_type"):
            return None
        dims = vi.type.tensor_type.shape.dim
        if not vi.type.tensor_type.HasField("shape") or len(dims) < 1:
            return None
        rest = [d.dim_value if d.HasField("dim_value") else -1 for d in dims[1:]]
        if any(d < 1 for d in rest) or vi.type.tensor_type.elem_type not in _STEP_OUTPUT_TYPES:
            return None
        return np.empty((rows, *rest), _STEP_OUTPUT_TYPES[vi.type.tensor_type.elem_type])

    def bind_step(
        self,
        feeds: Mapping[str, np.ndarray],
        output_names: Sequence[str],
        into: Mapping[str, np.ndarray] | None = None,
    ) -> None:
        """Bind step inputs that later steps update in place, for :meth:`run_bound` to run without rebinding.

        Each array is bound by reference (an ``OrtValue`` over its memory: ONNX Runtime reads what the array
        holds when the step runs), so the caller must keep its dtype, shape and buffer; new arrays need a new
        ``bind_step``. The caches are bound as :meth:`run` binds them; ``output_names`` are fetched each run,
        into a fresh array, except those ``into`` names: ONNX Runtime writes them into the given arrays
        (:meth:`step_output` makes them), which :meth:`run_bound` returns and every later run overwrites.
        """
        into = dict(into or {})
        with self._lock:
            io = self.session._sess.io_binding()
            for name, ov in self._values.items():
                io.bind_ortvalue_input(name, ov)
            for out_name, in_name in self._cache_outputs.items():
                io.bind_ortvalue_output(out_name, self._values[in_name])
            values = {}
            for name, array in feeds.items():
                if name in self._values:
                    raise ValueError(f"{name!r} is a cache owned by this PagedSession; do not feed it")
                self._check_rank(name, array)
                ov = _by_reference(name, array)
                io.bind_ortvalue_input(name, ov)
                values[name] = (array, ov)  # the arrays and their OrtValues stay alive while bound
            written = {}
            for name, array in into.items():
                if name not in output_names or name in self._cache_outputs:
                    raise InvalidParameter(
                        "PagedSession.bind_step", f"into[{name!r}]", f"one of the fetched outputs {output_names}", name
                    )
                ov = _by_reference(f"into[{name!r}]", array)
                io.bind_ortvalue_output(name, ov)
                written[name] = (array, ov)
            fetched = [n for n in output_names if n not in self._cache_outputs and n not in written]
            for name in fetched:
                io.bind_output(name, "cpu")
            self._step_binding = (io, fetched, values, written)

    def run_bound(self) -> dict[str, np.ndarray]:
        """Run one step on the inputs :meth:`bind_step` bound, as they are now; return the fetched outputs."""
        with self._lock:
            if self._step_binding is None:
                raise InvalidParameter("PagedSession.run_bound", "binding", "a step bound by bind_step first", None)
            io, fetched, _, written = self._step_binding
            self.session._sess.run_with_iobinding(io)
            out = self._fetched(io, fetched, len(written)) if fetched else {}
            for name, (array, _) in written.items():
                out[name] = array
            return out

    def _fetched(self, io: ort.IOBinding, fetched: list[str], written: int = 0) -> dict[str, np.ndarray]:
        # outputs in binding order: the caches (bound first, once), the fetched ones, then ``written`` outputs
        # bound to the caller's arrays. Only the fetched ones are wrapped (get_outputs would wrap every cache
        # output too: 2 per layer, each step)
        values = io.get_outputs_as_ortvaluevector()
        first = len(values) - len(fetched) - written
        # a numpy view of each fetched output (the view keeps its buffer alive, and the next step binds a fresh
        # output, so nothing overwrites it): no copy of logits rows the caller never samples
        out = {}
        for i, name in enumerate(fetched):
            ov = ort.OrtValue(values[first + i])
            out[name] = ortvalue_to_numpy(ov) if _is_raw_type_str(ov.data_type()) else ov.numpy()
        return out

    def _check_rank(self, name: str, value: Any) -> None:
        dims = self._declared.get(name)
        shape = tuple(value.shape()) if isinstance(value, ort.OrtValue) else np.shape(value)
        if dims is not None and len(shape) != len(dims):
            declared = ", ".join(str(d) for d in dims)
            raise InvalidParameter(
                "PagedSession.run", name, f"a rank-{len(dims)} array [{declared}] (the converted model's input)", shape
            )

    def _binding(self, fetched: list[str], fed: list[str]):
        """The IO binding kept across steps: the caches are bound once (input and aliasing output); each step
        rebinds only its feeds and fetched outputs. Made again when the fed or fetched names change: a name
        bound before and not rebound now would keep the previous step's buffer (an input's may be freed)."""
        key = (fetched, sorted(fed))
        if self._io is None or self._io_key != key:
            io = self.session._sess.io_binding()
            for name, ov in self._values.items():
                io.bind_ortvalue_input(name, ov)
            for out_name, in_name in self._cache_outputs.items():
                io.bind_ortvalue_output(out_name, self._values[in_name])
            self._io, self._io_key = io, key
        return self._io


# the step outputs PagedSession.step_output preallocates: types numpy and ortvalue_from_numpy both hold
_STEP_OUTPUT_TYPES = {onnx.TensorProto.FLOAT: np.float32, onnx.TensorProto.FLOAT16: np.float16}


def _by_reference(name: str, array: np.ndarray) -> ort.OrtValue:
    """An OrtValue over ``array``'s own memory (ONNX Runtime reads and writes the array itself), or an error."""
    ov = ort.OrtValue.ortvalue_from_numpy(array) if isinstance(array, np.ndarray) and array.flags.c_contiguous else None
    if ov is None or ov.data_ptr() != array.ctypes.data:
        raise InvalidParameter(
            "PagedSession.bind_step", name, "a C-contiguous numpy array bound by reference", "a copy"
        )
    return ov


def _raw(dtype: np.dtype):
    dtype = np.dtype(dtype)
    return {1: np.uint8, 2: np.uint16, 4: np.uint32}[dtype.itemsize] if dtype.kind == "V" else dtype


def _check_pool_fits(label: str, device: str, layout: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    """Refuse, before allocating, caches that exceed the device's total memory (absurd declared dims)."""
    from ortpa.runtime.kv_memory import device_memory_bytes

    need = sum(math.prod(shape) * dtype.itemsize for shape, dtype in layout.values())
    have = device_memory_bytes(device)
    if have is not None and need > have:
        name, (shape, dtype) = max(layout.items(), key=lambda kv: math.prod(kv[1][0]) * kv[1][1].itemsize)
        raise KVPoolTooLarge(
            label, need, have, f"{len(layout)} caches on {device}, the largest {name!r} {list(shape)} {dtype}"
        )


def _concrete_shape(
    vi: onnx.ValueInfoProto, name: str, num_blocks: int, block_size: int | None, dims: Mapping[str, int]
) -> tuple[int, ...]:
    shape = []
    sym_defaults: dict[int, int | None] = {0: num_blocks, 1: block_size}
    for axis, dim in enumerate(vi.type.tensor_type.shape.dim):
        if dim.HasField("dim_value"):
            value = dim.dim_value
            if axis == 0 and value != num_blocks:
                raise InvalidParameter(
                    "PagedSession", "num_blocks", f"the model's {value} blocks (cache input {name})", num_blocks
                )
            if axis == 1 and block_size is not None and value != block_size:
                raise InvalidParameter(
                    "PagedSession", "block_size", f"the model's block_size {value} (cache input {name})", block_size
                )
        elif dim.dim_param in dims:
            value = dims[dim.dim_param]
        elif sym_defaults.get(axis) is not None:
            value = sym_defaults[axis]
        else:
            raise InvalidParameter(
                "PagedSession",
                "dims",
                f"a value for the symbolic dimension {axis} ({dim.dim_param or '?'}) of cache input {name} "
                "(pass it in dims= or block_size=)",
                None,
            )
        shape.append(int(value))
    if len(shape) != 4:
        raise InvalidModel(name, f"expected a 4-D cache input, found rank {len(shape)}")
    return tuple(shape)
