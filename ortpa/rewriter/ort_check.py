"""The conversion's last check: the written graph opened by ONNX Runtime on each provider the model is meant for.

Opened the way :class:`ortpa.InferenceSession` opens it (the same planning: PagedAttention native where the
provider has a kernel that takes the node, ortpa's portable lowering elsewhere, i.e. always on CPU), on the graph
with its large weights as typed inputs (:func:`ortpa.rewriter.model_store.weightless`), so ONNX Runtime resolves
every type and looks up every kernel without reading a weight. A missing kernel is therefore never excused: the
only op ONNX Runtime's CPU lacks, PagedAttention, is not in the graph it is asked to run. What fails is an error
naming the op, how many nodes have it, and what to pass instead; nothing is written.

Which providers: :func:`meant_for` (the CLI's ``convert --providers``; default CPU and CUDA). CUDA is checked
where this machine has a CUDA device; elsewhere the check says that it did not run (``progress``), rather than
passing silently.
"""

from __future__ import annotations

import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Sequence

import onnx

from ortpa.errors import ConversionError, OrtpaError
from ortpa.runtime.device import PROVIDER_NAMES, has_cuda, providers_for

__all__ = ["check_runs", "meant_for", "providers_meant_for"]

_DEFAULT = ("cpu", "cuda")
_MEANT_FOR: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("ortpa_meant_for", default=_DEFAULT)
_NO_KERNEL = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")
# what to pass instead, by the dtype the missing kernel was asked for
_REMEDY = {
    "bfloat16": "convert with --dtype float16 (a checkpoint folder: --export-dtype float16 or float32), "
    "or pass --providers cuda if the model is meant for CUDA only",
}
_REMEDY_ANY = "--verbose shows the traceback; --providers says where the model is meant to run"


@contextlib.contextmanager
def meant_for(providers: Sequence[str]) -> Iterator[None]:
    """Within the block, conversions check the model on ``providers`` (``"cpu"``, ``"cuda"``)."""
    unknown = [p for p in providers if p not in PROVIDER_NAMES]
    if unknown or not providers:
        raise ValueError(f"providers must be a non-empty subset of {sorted(PROVIDER_NAMES)}, got {list(providers)}")
    token = _MEANT_FOR.set(tuple(dict.fromkeys(providers)))
    try:
        yield
    finally:
        _MEANT_FOR.reset(token)


def providers_meant_for() -> tuple[str, ...]:
    return _MEANT_FOR.get()


def _input_dtypes(proto: onnx.ModelProto, node_name: str) -> tuple[str, list[str]]:
    """(the failing node's input element type by name, the names of every node of its op on that type), found by
    shape inference: what the message counts."""
    from ortpa.ops.shape_inference import infer_shapes

    inferred = infer_shapes(proto)
    g = inferred.graph
    types = {v.name: v.type.tensor_type.elem_type for v in [*g.input, *g.value_info, *g.output]}
    types.update({i.name: i.data_type for i in g.initializer})
    node = next((n for n in g.node if n.name == node_name), None)
    if node is None:
        return "", []
    elem = next((types[i] for i in node.input if i and types.get(i)), 0)
    same = [n.name for n in g.node if n.op_type == node.op_type and any(types.get(i) == elem for i in n.input if i)]
    return onnx.helper.tensor_dtype_to_np_dtype(elem).name if elem else "", same


def _check_one(graph: onnx.ModelProto, provider: str) -> None:
    import onnxruntime as ort

    from ortpa.runtime.session import InferenceSession  # the runtime's own planning and portable lowering

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        InferenceSession(graph, opts, providers=providers_for(provider))  # CUDA falls back to CPU, as deployed
    except OrtpaError as exc:
        text = str(exc)
        match = _NO_KERNEL.search(text)
        if match is None:  # a mode the portable op does not implement, a graph ORT rejects, ...
            raise ConversionError(
                f"the converted model cannot run on {provider.upper()}: {text.splitlines()[0][:400]}; {_REMEDY_ANY}"
            ) from exc
        op, version, node = match.groups()
        elem, same = _input_dtypes(graph, node)
        dtype = elem or "a"
        count = f"{len(same)} node(s), e.g. {node}" if same else node
        raise ConversionError(
            f"the converted model cannot run on {provider.upper()}: ONNX Runtime has no {dtype} kernel for "
            f"{op}({version}) ({count}); {_REMEDY.get(elem, _REMEDY_ANY)}"
        ) from exc


def check_runs(proto: onnx.ModelProto, progress: Callable[[str], None] | None = None) -> None:
    """Raise :class:`~ortpa.errors.ConversionError` unless ONNX Runtime opens ``proto`` (weights or not) on every
    provider of :func:`providers_meant_for`; CUDA only where a CUDA device is present (else ``progress`` says so)."""
    from ortpa.rewriter.model_store import weightless

    graph = weightless(proto)
    for provider in providers_meant_for():
        if provider == "cuda" and not has_cuda():
            if progress is not None:
                progress("not checked on CUDA: no CUDA device on this machine")
            continue
        _check_one(graph, provider)
