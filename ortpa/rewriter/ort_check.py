"""The conversion's last check: the written graph opened by ONNX Runtime on each provider the model is meant for.

Opened the way :class:`ortpa.InferenceSession` opens it (the same planning: PagedAttention native where the
provider has a kernel that takes the node, ortpa's portable lowering elsewhere, i.e. always on CPU), on the graph
with its large weights as typed inputs (:func:`weightless`), so ONNX Runtime resolves
every type and looks up every kernel without reading a weight. A missing kernel is therefore never excused: the
only op ONNX Runtime's CPU lacks, PagedAttention, is not in the graph it is asked to run. What fails is an error
naming the op, how many nodes have it, and what to pass instead; nothing is written.

Which providers: the conversion's ``providers`` argument (the CLI's ``convert --providers``; default CPU and
CUDA), passed down explicitly. CUDA is checked
where this machine has a CUDA device; elsewhere the check says that it did not run (``progress``), rather than
passing silently.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import onnx

from ortpa.errors import ConversionError, InvalidParameter, OrtpaError
from ortpa.progress import Progress, Stage, report
from ortpa.providers import PROVIDER_NAMES, providers_for
from ortpa.runtime.device import has_cuda

__all__ = ["DEFAULT_PROVIDERS", "check_runs", "checked_providers", "weightless"]

# where a converted model is meant to run unless the caller says otherwise (the CLI's --providers)
DEFAULT_PROVIDERS: tuple[str, ...] = ("cpu", "cuda")
_NO_KERNEL = re.compile(r"Could not find an implementation for (\w+)\((\d+)\) node with name '([^']*)'")
# what to pass instead, by the dtype the missing kernel was asked for
_REMEDY = {
    "bfloat16": "convert with --dtype float16 (a checkpoint folder: --export-dtype float16 or float32), "
    "or pass --providers cuda if the model is meant for CUDA only",
}
_REMEDY_ANY = "--verbose shows the traceback; --providers says where the model is meant to run"


def checked_providers(providers: Sequence[str]) -> tuple[str, ...]:
    """``providers`` (``"cpu"``, ``"cuda"``) as a tuple without repeats; anything else is an error."""
    unknown = [p for p in providers if p not in PROVIDER_NAMES]
    if unknown:
        raise InvalidParameter("convert", "providers", f"a subset of {sorted(PROVIDER_NAMES)}", list(providers))
    return tuple(dict.fromkeys(providers))


_SESSION_CHECK_MIN_BYTES = 4096  # initializers the ORT load check sees as typed graph inputs instead


def weightless(proto: onnx.ModelProto, min_bytes: int = _SESSION_CHECK_MIN_BYTES) -> onnx.ModelProto:
    """A copy of ``proto`` whose initializers of ``min_bytes`` or more (inline or external) are typed graph
    inputs: ONNX Runtime resolves the graph's types and kernels exactly as with the weights, without them."""
    from ortpa.runtime.ort_session import copy_without_initializers  # runtime: no import cycle

    out = copy_without_initializers(proto)
    for init in proto.graph.initializer:
        count = 1
        for d in init.dims:
            count *= int(d)
        external = init.data_location == onnx.TensorProto.EXTERNAL
        if external or count * _itemsize(init.data_type) >= min_bytes:
            out.graph.input.append(onnx.helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
        else:
            out.graph.initializer.append(init)
    return out


def _itemsize(data_type: int) -> int:
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(data_type).itemsize
    except Exception:
        return 1


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


def check_runs(
    proto: onnx.ModelProto,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    progress: Progress | None = None,
) -> None:
    """Raise :class:`~ortpa.errors.ConversionError` unless ONNX Runtime opens ``proto`` (weights or not) on every
    provider of ``providers``; CUDA only where a CUDA device is present (else ``progress`` says so)."""
    graph = weightless(proto)
    for provider in checked_providers(providers):
        if provider == "cuda" and not has_cuda():
            report(progress, Stage.CHECK, "not checked on CUDA: no CUDA device on this machine")
            continue
        _check_one(graph, provider)
