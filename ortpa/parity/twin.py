"""Verification's float32 twin: the converted model with its attention and caches in float32.

A converted model whose original computes in float32 casts q/k/v (and the op's constant inputs: RoPE tables,
q/k-norm weights, sinks) to the op's type T just before each PagedAttention node and its output back after it
(:func:`ortpa.rewriter.attention.op_constant`). :func:`float32_twin` retargets those casts to float32, declares
the caches float32 (an int8 cache's quantization is dropped with it) and lowers every node to the portable op
built for float32 (:func:`ortpa.ops.portable.lower_to_portable`'s ``configure``; the op's own type rules allow
only float16/bfloat16, the portable graph computes in float32 anyway). What is left is the same rewrite, in the
original's arithmetic: it differs from the original only by reordered float32 sums, so it can be compared at a
float32 bound (:func:`ortpa.tolerances.structure_bound`) where any structural mistake shows by orders of
magnitude.

Where the original computes in a half type itself (a float16 original; bfloat16 and FP8 checkpoints exported as
float16) no cast marks the boundary: both sides get a float32 twin (``float32_twin(upcast=True)`` and
:func:`float32_original`, by :func:`ortpa.parity.upcast.upcast_to_float32`), the original's after the constant
folding the conversion does, in the original's arithmetic. Half weights the conversion computed (MLA's absorbed
projections) cannot be unrounded: :attr:`Twin.computed` counts them for the bound. Where the converted model
computes in T and the original does not (a ``dtype=`` conversion of a float32 original: its weights are rounded
to T, the original's are not) the conversion's twin is the same upcast one, and the original's computes in float32
from its weights rounded to T where the conversion stores them so (:func:`ortpa.parity.rounded.rounded_original`).

A file whose nodes were lowered already (``convert --portable``) has calls of model-local functions instead of
PagedAttention nodes: its twin is the whole header upcast (the casts to T before the calls, the functions' own
casts and the caches float32), so the file's own function bodies run in float32; an int8 cache, quantized inside
the function, leaves it without a twin. The twins share the rewrite and the weights: only the graph header is
changed (in the one copy :func:`ortpa.model.file.read_model` returns), the weights stay in the models' files.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Collection
from dataclasses import dataclass

import onnx

from ortpa.dtypes import dtype_name
from ortpa.model.file import LoadedModel
from ortpa.parity.activations import INT8_ACTIVATION_OPS, int8_activation_matmuls
from ortpa.parity.products import rebuild_products
from ortpa.parity.upcast import read_names, upcast_to_float32

__all__ = [
    "Twin",
    "accumulation_length",
    "float32_original",
    "float32_twin",
    "folded_original",
    "is_lowered_call",
    "source_arithmetic",
]

_HALF = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
# the op's inputs a cast to T may feed (schema indices): query, key, value, cos, sin, head_sink, q/k-norm weights
_CAST_SLOTS = (0, 1, 2, 8, 9, 11, 12, 13)
_CACHE_SLOTS = (3, 4)
# ops that select or reshape rows of a value without changing its type
_ROW_OPS = ("Gather", "Unsqueeze", "Squeeze", "Reshape")


@dataclass
class Twin:
    """``model``: the float32 twin to open (None: the deployed model is its own twin); ``arithmetic``: the
    precision its attention runs in (``"float32"``, or the deployed model's T); ``reason``: why there is none."""

    model: LoadedModel | None
    arithmetic: str
    reason: str = ""
    accumulation: int = 1  # the longest sum of products in the model (ortpa.tolerances.structure_tolerance)
    layers: int = 1  # attention layers: the residual stream adds one rounding per layer
    computed: int = 0  # weights per layer the conversion computed and stored in ``stored`` (upcast twins only)
    stored: str = "float16"


def float32_twin(
    converted: str | os.PathLike | LoadedModel,
    *,
    upcast: bool = False,
    original: LoadedModel | None = None,
    accounted: Collection[str] = (),
) -> Twin:
    """The float32 twin of ``converted`` (a path, or a model :func:`~ortpa.model.file.read_model` read).
    ``upcast``: the original computes in a half type itself, and the converted model with it; the twin then
    computes everything in float32 (:func:`ortpa.parity.upcast.upcast_to_float32`), to be compared with the
    original's own float32 twin (:func:`float32_original`), passed as ``original``: the converted model's half
    weights that it lacks are weights the conversion computed (MLA's absorbed projections), stored rounded,
    counted into :attr:`Twin.computed` for the bound; ``accounted`` names half weights the original's twin holds
    under other names (copies, :func:`rounded_original`), not counted."""
    from ortpa.model.file import read_model
    from ortpa.ops.portable import lower_to_portable, value_types
    from ortpa.ops.shape_inference import infer_shapes
    from ortpa.ops.spec import DOMAIN, OP_TYPE
    from ortpa.runtime.ort_session import external_initializers

    loaded = converted if isinstance(converted, LoadedModel) else read_model(converted, load_external_data=False)
    proto = loaded.proto
    graph = proto.graph
    nodes = [n for n in graph.node if n.op_type == OP_TYPE and n.domain == DOMAIN]
    if not nodes:
        return _portable_twin(loaded, upcast=upcast, original=original, accounted=accounted)
    sizes = {"accumulation": accumulation_length(proto), "layers": len(nodes)}
    own = source_arithmetic(proto)
    # int8: activations quantized by the original's own projections (kept; ortpa.parity.activations switches them)
    if own not in ("float32", "int8") and not upcast:
        # a dtype= conversion of a float32 original: its weights are rounded to T, which the original's are not
        return Twin(None, own, f"the converted model computes in {own} throughout", **sizes)
    producers = {o: n for n in graph.node for o in n.output}
    graph_inputs = {i.name: i for i in graph.input}
    readers: dict[str, list[onnx.NodeProto]] = {}
    for n in graph.node:
        for i in n.input:
            readers.setdefault(i, []).append(n)
    cache_outputs = {o for n in nodes for o in n.output[1:3] if o}

    def feeds_attention_only(value: str) -> bool:
        """Every reader of ``value`` is an attention node, a row selection / reshape whose result is, or the
        write of graph-computed rows into an attention node's cache output (the expanded MLA prefill's fresh
        rows): retargeted to float32 together, these stay consistent in the twin."""
        for r in readers.get(value, []):
            if r.op_type == OP_TYPE and r.domain == DOMAIN:
                continue
            if r.op_type in _ROW_OPS and r.input[0] == value and feeds_attention_only(r.output[0]):
                continue
            if r.op_type == "ScatterND" and r.input[2] == value and r.input[0] in cache_outputs:
                continue
            return False
        return True

    casts: set[str] = set()
    caches: set[str] = set()
    t_dtype = ""
    for node in nodes if not upcast else []:  # upcast: no cast marks T's boundary, everything becomes float32
        for slot in _CAST_SLOTS:
            name = node.input[slot] if slot < len(node.input) else ""
            if not name:
                continue
            cast = producers.get(name)
            while cast is not None and cast.op_type == "Gather":  # a row selection (the absorbed rows) keeps T
                cast = producers.get(cast.input[0])
            to = next((a.i for a in cast.attribute if a.name == "to"), None) if cast is not None else None
            if cast is None or cast.op_type != "Cast" or to not in _HALF:
                what = "a graph input or constant" if cast is None else f"{cast.op_type} '{cast.name}'"
                arithmetic = t_dtype or _declared_t(loaded, node.input[0])
                reason = f"'{node.name}' input {slot} comes from {what}, not a cast to T"
                return Twin(None, arithmetic, reason, **sizes)
            if not feeds_attention_only(cast.output[0]):
                reason = f"the cast to T of '{node.name}' input {slot} has other readers"
                return Twin(None, dtype_name(to), reason, **sizes)
            casts.add(cast.output[0])
            t_dtype = t_dtype or dtype_name(to)
    for node in nodes:
        for slot in _CACHE_SLOTS:
            if slot < len(node.input) and node.input[slot] in graph_inputs:
                caches.add(node.input[slot])
    outputs = {i: o for n in nodes for i, o in zip(n.input[3:5], n.output[1:3], strict=False) if i in caches}
    # a cache output that gets the graph's own rows afterwards (the expanded MLA prefill): the write's output is
    # the graph's present cache
    written = {
        r.input[0]: r.output[0] for o in outputs.values() for r in readers.get(o, []) if r.op_type == "ScatterND"
    }
    outputs = {i: written.get(o, o) for i, o in outputs.items()}

    # the op's validated configuration comes from the model as written; only the function is built for float32
    header, _ = external_initializers(proto, loaded.base_dir)  # weight-free: large tensors as references
    types = value_types(infer_shapes(header))
    lowered = lower_to_portable(header, types=types, configure=_float32)

    del graph.node[:]
    graph.node.extend(lowered.graph.node)
    for node in graph.node:
        if node.op_type == "Cast" and node.output[0] in casts:
            for a in node.attribute:
                if a.name == "to":
                    a.i = onnx.TensorProto.FLOAT
    proto.functions.extend(lowered.functions)
    have = {o.domain for o in proto.opset_import}
    proto.opset_import.extend(o for o in lowered.opset_import if o.domain not in have)
    for value in [*graph.input, *graph.output]:
        if value.name in caches or value.name in outputs.values():
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
    # the written types of what now is float32 (the op's outputs, the casts) would contradict the twin
    # (and every half-typed value: in a float32 model those are the conversion's boundary, now float32)
    stale = casts | caches | {o for n in nodes for o in n.output}
    kept = [vi for vi in graph.value_info if vi.name not in stale and vi.type.tensor_type.elem_type not in _HALF]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    # what the float32 op no longer reads (an int8 cache's scales) goes: ONNX Runtime would prune it after ortpa
    # registered its bytes as an external initializer, and refuse the registration
    read = read_names(graph.node)
    kept_inits = [i for i in graph.initializer if i.name in read or i.name in {o.name for o in graph.output}]
    if len(kept_inits) < len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(kept_inits)
    reason = ""
    if upcast:
        if original is not None:  # MLA's products: rebuilt from the original's factors, exact (ortpa.parity.products)
            accounted = {*accounted, *rebuild_products(proto, original)}
        reason = _count_computed(proto, original, accounted, len(nodes), sizes)
        upcast_to_float32(proto)
    twin = dataclasses.replace(loaded, proto=proto, label=f"{loaded.label} (float32 twin)")
    return Twin(twin, "float32", reason, **sizes)


def _count_computed(
    proto: onnx.ModelProto, original: LoadedModel | None, accounted: Collection[str], layers: int, sizes: dict
) -> str:
    """The half weights of ``proto`` that ``original`` (its twin) lacks: weights the conversion computed and
    stored rounded (MLA's absorbed projections), which no twin unrounds. Counted per layer into ``sizes``
    (:attr:`Twin.computed`) for the bound; the reason that names them, or ``""``."""
    known = {i.name for i in original.proto.graph.initializer} if original is not None else set()
    known |= set(accounted)
    computed = [i for i in proto.graph.initializer if i.data_type in _HALF and i.name not in known and _size(i) > 64]
    if not computed:
        return ""
    stored = dtype_name(computed[0].data_type)
    sizes.update(computed=-(-len(computed) // max(layers, 1)), stored=stored)
    return (
        f"{len(computed)} weights the conversion computed (e.g. '{computed[0].name}') are stored in {stored}: "
        "their rounding is in the bound"
    )


def _portable_twin(
    loaded: LoadedModel, *, upcast: bool, original: LoadedModel | None, accounted: Collection[str]
) -> Twin:
    """The float32 twin of a file whose PagedAttention nodes were lowered already (``convert --portable``): each
    node is a call of a model-local function (:mod:`ortpa.ops.portable`) that reads T and the caches' type and
    computes in float32 inside. The whole header is upcast (:func:`ortpa.parity.upcast.upcast_to_float32`): the
    casts to T before the calls, the functions' casts to T and the caches become float32, so the file's own
    function bodies run in float32 (a defect in a body is in the twin too). A cache quantized inside the
    function (int8) keeps its quantization: no twin then (the deployed model is its own, at int8's bound)."""
    from ortpa.ops.portable import lowered_cache_ports

    proto = loaded.proto
    calls = [n for n in proto.graph.node if is_lowered_call(n)]
    if not calls:
        return Twin(None, "float32", "no PagedAttention node, lowered or not")
    sizes = {"accumulation": accumulation_length(proto), "layers": len(calls)}
    declared = {v.name: v.type.tensor_type.elem_type for v in proto.graph.input}
    for port in lowered_cache_ports(proto):
        kind = declared.get(port.input_name)
        if kind not in (*_HALF, onnx.TensorProto.FLOAT):
            what = f"{dtype_name(kind)} cache '{port.input_name}'"
            reason = f"the lowered attention quantizes its {what} inside its function"
            return Twin(None, dtype_name(kind), reason, **sizes)
    if upcast and original is not None:
        accounted = {*accounted, *rebuild_products(proto, original)}
    reason = _count_computed(proto, original, accounted, len(calls), sizes) if upcast else ""
    upcast_to_float32(proto)
    twin = dataclasses.replace(loaded, proto=proto, label=f"{loaded.label} (float32 twin)")
    return Twin(twin, "float32", reason, **sizes)


def is_lowered_call(node: onnx.NodeProto) -> bool:
    """A PagedAttention node lowered to a call of its portable layer function (not the step's plan call)."""
    from ortpa.ops.portable import FUNCTION_DOMAIN

    return node.domain == FUNCTION_DOMAIN and node.op_type.startswith("PagedAttention_")


def _size(init: onnx.TensorProto) -> int:
    n = 1
    for d in init.dims:
        n *= d
    return n


def float32_original(original: str | os.PathLike) -> LoadedModel:
    """The float32 twin of an original that computes in a half type, its weights read from its own files.

    First the constants the conversion folds (``onnxscript.optimizer.optimize``, as
    :func:`ortpa.rewriter.pipeline.rewrite` runs it) are folded here too (:func:`_fold_as_the_conversion`: its
    folding without its rewrite rules), in the original's own arithmetic: a
    softmax scale ``sqrt(float16(1/sqrt(d)))`` or a ``1 + weight`` is the half value in the converted model, and
    must be the same value in both twins. Then the graph is upcast
    (:func:`ortpa.parity.upcast.upcast_to_float32`)."""
    loaded, proto = folded_original(original)
    upcast_to_float32(proto)
    return dataclasses.replace(loaded, proto=proto, label=f"{loaded.label} (float32 twin)")


def folded_original(original: str | os.PathLike) -> tuple[LoadedModel, onnx.ModelProto]:
    """``original``'s header after the constant folding the conversion runs first
    (``onnxscript.optimizer.optimize``), in the original's own arithmetic; weights stay in its files."""
    import onnx_ir as ir

    from ortpa.model.file import read_model
    from ortpa.rewriter.model_store import load_ir

    loaded = read_model(original, load_external_data=False)
    irm = load_ir(original)  # external weights stay lazy: only the small constants the optimizer folds are read
    _fold_as_the_conversion(irm)
    proto = ir.serde.serialize_model(irm)
    del irm
    return loaded, proto


def _fold_as_the_conversion(irm) -> None:
    """``onnxscript.optimizer.optimize`` (what the conversion runs) without its rewrite rules: the constant folding
    and the passes after it, in the same order, so the folded values and the value names are the conversion's.
    The rules (no-op, cast, reshape, transpose, slice and clip simplifications) keep values and names and change
    no arithmetic of a float32 twin (every cast in it casts to float32), and are 90 % of the optimizer's time
    (5 s of 5.3 s on a 16-layer model: a pattern match per node and rule)."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    import onnxscript.optimizer

    common.InlinePass()(irm)
    for _ in range(2):  # the optimizer's two iterations, stopped early as it does when nothing changed
        if not onnxscript.optimizer.fold_constants(irm).modified:
            break
        common.RemoveUnusedNodesPass()(irm)
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(),
        common.RemoveUnusedFunctionsPass(),
        common.RemoveUnusedOpsetsPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(),
        common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(),
        common.OutputFixPass(),
        common.NameFixPass(),
    )(irm)


def accumulation_length(proto: onnx.ModelProto) -> int:
    """The longest dot product of ``proto``: the largest contracted dimension of a MatMul / Gemm weight (the
    MLP's intermediate size in a transformer), read from the initializers' declared dims; 1 when none is found."""
    dims = {i.name: list(i.dims) for i in proto.graph.initializer}
    longest = 1
    for node in proto.graph.node:
        if node.op_type == "MatMul" and len(node.input) > 1 and len(dims.get(node.input[1], [])) == 2:
            longest = max(longest, dims[node.input[1]][0])
        elif node.op_type == "Gemm" and len(node.input) > 1 and len(dims.get(node.input[1], [])) == 2:
            trans_b = any(a.name == "transB" and a.i for a in node.attribute)
            longest = max(longest, dims[node.input[1]][1 if trans_b else 0])
        elif node.op_type == "MatMulNBits":
            longest = max(longest, next((a.i for a in node.attribute if a.name == "K"), 1))
    return longest


def _float32(cfg):
    """The portable configuration of a float32 twin: T and caches float32, no cache quantization."""
    import onnx_ir as ir

    scales = ("k_scale", "v_scale")
    return dataclasses.replace(
        cfg,
        act_dtype=int(ir.DataType.FLOAT),
        cache_dtype=int(ir.DataType.FLOAT),
        k_quant="NONE",
        v_quant="NONE",
        present_inputs=tuple(x for x in cfg.present_inputs if x not in scales),
    )


def _declared_t(loaded: LoadedModel, query: str) -> str:
    for vi in [*loaded.proto.graph.value_info, *loaded.proto.graph.input]:
        if vi.name == query:
            return dtype_name(vi.type.tensor_type.elem_type)
    return "float16"


def source_arithmetic(proto: onnx.ModelProto) -> str:
    """The coarsest arithmetic an original model performs outside attention, read from its graph: ``"int8"``
    where its projections quantize activations (MatMulNBits ``accuracy_level=4``, dynamic quantization), else the
    element type of its largest float weight (``"float32"``, ``"float16"``, ``"bfloat16"``)."""
    if int8_activation_matmuls(proto) or any(n.op_type in INT8_ACTIVATION_OPS for n in proto.graph.node):
        return "int8"
    floats = (onnx.TensorProto.FLOAT, *_HALF)
    best, size = onnx.TensorProto.FLOAT, -1
    for init in proto.graph.initializer:
        if init.data_type in floats:
            n = 1
            for d in init.dims:
                n *= d
            if n > size:
                best, size = init.data_type, n
    return dtype_name(best)
