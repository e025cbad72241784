"""``com.microsoft::PagedAttention`` in standard ONNX ops, runnable by any execution provider (ONNX Runtime CPU).

:func:`lower_to_portable` replaces each PagedAttention node by a call to a model-local ONNX function (built by
:mod:`ortpa.ops.portable.layer`, one per distinct configuration) with the node's inputs and outputs, so graph
input/output names are unchanged. The index work of a step (sanitization, write set, decode / prefill groups,
masks, output rows) depends only on the index inputs, so it is one *plan* call, placed before the first layer,
whose outputs every layer with the same index inputs and the same declared token and cache dimensions takes as
extra inputs: computed once per step instead of once per layer (:mod:`ortpa.ops.portable.plan`). The layer
function is specialised on the node's attributes, on which optional inputs are present and on the declared
element types; it computes in float32 from float16/bfloat16 inputs and writes the caches in their own element
type.

In-place cache update: ``key_cache_out`` / ``value_cache_out`` come straight out of a ``ScatterND`` whose
data input is the cache graph input. Bind the same OrtValue to a cache input and its cache output
(IO binding) and ONNX Runtime's CPU ScatterND sees input buffer == output buffer and skips its full-cache
copy: the step costs the same with 64 or 4096 blocks. With plain ``session.run`` the cache outputs are
fresh arrays (a full copy per call). A node without cache outputs still attends to the new tokens, but the
written cache is then internal to the call: the caller's cache is not updated (unlike CUDA, which writes
through a const input).

Decoding sequences (one new token) and prefilling ones attend in separate padded groups, so a mixed step
costs about its parts. Memory per call (``D`` decodes whose longest live KV length is ``kv_d``; ``P`` prefills
whose longest query / KV length are ``max_q`` / ``kv_p``): float32 scores and probabilities
``O((D * kv_d + P * max_q * kv_p) * num_heads)``; gathered K and V ``O((D * kv_d + P * kv_p) * kv_heads *
head_size)`` in the cache type plus a float32 copy; padded Q and output ``O((D + P * max_q) * num_heads *
head_size)``. Nothing is proportional to ``num_blocks``. A long prefill (one sequence of ``L`` tokens) therefore needs
``num_heads * L * L * 4`` bytes of scores: chunk prefills on CPU.

Unsupported (raise :class:`~ortpa.errors.NotImplementedByBackend` before any run): float8e4m3fn caches (ONNX
``Gather``/``ScatterND`` do not accept float8, so neither the in-place write nor a block-wise read exists),
packed int4 (uint8) caches, and head sizes or rotary widths that are not static in the model.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import onnx
import onnx_ir as ir
from onnx import helper

from ortpa.dtypes import onnx_elem_type
from ortpa.errors import NotImplementedByBackend
from ortpa.ops.backends import BACKENDS
from ortpa.ops.params import PagedAttentionParams
from ortpa.ops.portable.config import DEFAULT_OPSET, ORT_DOMAIN, PLAN_OUTPUTS, PlanConfig, PortableConfig
from ortpa.ops.portable.layer import build_function
from ortpa.ops.portable.plan import build_plan_function
from ortpa.ops.portable.tracer import FUNCTION_DOMAIN
from ortpa.ops.shape_inference import infer_shapes
from ortpa.ops.spec import DOMAIN, OP_TYPE, PAGED_ATTENTION
from ortpa.ops.trailing_write import trailing_writes
from ortpa.ops.validate import TensorInfo, check_inputs, dtype_name

__all__ = [
    "BACKEND",
    "PORTABLE_FEATURES",
    "LayerCall",
    "fused_decode_reason",
    "layer_call",
    "lower_nodes",
    "lower_to_portable",
    "node_attributes",
    "plan_call",
    "portable_config",
    "value_types",
]

BACKEND = "portable"

# What this backend implements, in ortpa.ops.backends' feature vocabulary (its `portable` entry must match).
# What this backend implements: declared once, in the backend gate.
PORTABLE_FEATURES: frozenset[str] = BACKENDS[BACKEND].supported

_MIN_OPSET = 18  # ReduceMax/ReduceMean with axes as an input, Split num_outputs
_INDEX = {f.name: f.index for f in PAGED_ATTENTION.inputs}  # schema name -> input position


def node_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


def _value_infos(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    return value_types(infer_shapes(model))  # knows PagedAttention, so later layers' queries get shapes too


def value_types(inferred: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Declared and inferred types of every value of a model that went through shape inference already."""
    g = inferred.graph
    types = {v.name: v.type for v in [*g.input, *g.value_info, *g.output]}
    for init in g.initializer:
        types.setdefault(init.name, helper.make_tensor_type_proto(init.data_type, list(init.dims)))
    return types


def _tensor_info(tp: onnx.TypeProto | None) -> TensorInfo:
    if tp is None or not tp.HasField("tensor_type"):
        return TensorInfo(shape=None, dtype=None)
    tt = tp.tensor_type
    shape = None
    if tt.HasField("shape"):
        shape = tuple(d.dim_value if d.HasField("dim_value") else None for d in tt.shape.dim)
    return TensorInfo(shape=shape, dtype=tt.elem_type or None)


def portable_config(
    node: onnx.NodeProto,
    types: Mapping[str, onnx.TypeProto],
    opset: int = DEFAULT_OPSET,
    *,
    fused: bool = True,
    constants: Collection[str] = (),
    if_free: bool = False,
) -> PortableConfig:
    """Validate ``node`` from declared types (ONNX Runtime's rules) and derive the function's configuration.

    ``fused``: let decodes attend through ONNX Runtime's ``com.microsoft::MultiHeadAttention`` where it computes
    the op's semantics (:func:`fused_decode_reason`); ``False`` keeps every kernel a standard ONNX op.
    ``constants``: names of the model's constant values (:func:`_constant_values`); RoPE tables among them are
    folded (see :func:`_foldable_rope`). ``if_free``: no ``If`` in the functions (``PortableConfig.if_free``)."""
    where = node.name or None
    names = list(node.input) + [""] * (len(PAGED_ATTENTION.inputs) - len(node.input))
    inputs = {f.name: _tensor_info(types.get(names[f.index])) for f in PAGED_ATTENTION.inputs if names[f.index] != ""}
    attrs = node_attributes(node)
    p: PagedAttentionParams = check_inputs(inputs, attrs, node=where, max_threads_per_block=0)

    storage = dtype_name(inputs["key_cache"].dtype)
    if storage in ("float8e4m3fn", "uint8"):
        kind = "float8e4m3fn" if storage == "float8e4m3fn" else "int4 (packed uint8)"
        raise NotImplementedByBackend(
            BACKEND,
            f"{kind} KV cache",
            "expected a float16, bfloat16 or int8 cache: ONNX Gather/ScatterND have no float8 or nibble form, "
            f"found key_cache of type {storage}",
            node=where,
        )
    if p.head_size is None or p.v_head_size is None:
        raise NotImplementedByBackend(
            BACKEND,
            "symbolic head size",
            "expected static hidden dimensions on 'query' (and 'key'), found a symbolic one",
            node=where,
        )
    if p.do_rotary and "cos_cache" in inputs and inputs["cos_cache"].shape is not None:
        if _dim(inputs["cos_cache"].shape, 1) is None:
            raise NotImplementedByBackend(
                BACKEND, "symbolic rotary width", "expected a static cos_cache dimension 1, found a symbolic one", where
            )
    act = dtype_name(inputs["query"].dtype)
    if act not in ("float16", "bfloat16") or storage is None:
        raise NotImplementedByBackend(
            BACKEND,
            "undeclared element types",
            f"expected declared types for 'query' and 'key_cache', found {act!r} and {storage!r}",
            node=where,
        )
    rotary = p.do_rotary and p.rotary_dim > 0
    needed = {"query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens"}
    needed |= {"block_table", "slot_mapping", "head_sink", "q_norm_weight", "k_norm_weight"}
    if rotary:
        needed |= {"cos_cache", "sin_cache"}
    if p.k_quant_type != "NONE":
        needed.add("k_scale")
    if p.v_quant_type != "NONE" and not p.is_latent:
        needed.add("v_scale")
    present = tuple(f.name for f in PAGED_ATTENTION.inputs if f.name in inputs and f.name in needed)
    outs = list(node.output) + [""] * (3 - len(node.output))
    present_outputs = tuple(o.name for o in PAGED_ATTENTION.outputs if outs[o.index] != "")
    unfused = fused_decode_reason(p, has_sink="head_sink" in present)
    return PortableConfig(
        present_inputs=present,
        present_outputs=present_outputs,
        act_dtype=onnx_elem_type(act),
        cache_dtype=onnx_elem_type(storage),
        num_heads=p.num_heads,
        kv_num_heads=p.kv_num_heads,
        head_size=int(p.head_size),
        v_head_size=int(p.v_head_size),
        query_width=_dim(inputs["query"].shape, 1),
        latent=p.is_latent,
        packed_qkv=p.is_packed_qkv,
        scale=float(p.scale),
        softcap=float(p.softcap) if p.softcap > 0 else 0.0,
        local_window_size=int(p.local_window_size) if p.local_window_size > 0 else 0,
        is_causal=p.is_causal,
        rotary_dim=int(p.rotary_dim) if rotary else 0,
        rotary_interleaved=p.rotary_interleaved,
        rotary_offset=int(p.rotary_offset) if rotary else 0,
        use_qk_norm=p.use_qk_norm,
        qk_norm_epsilon=float(p.qk_norm_epsilon),
        k_quant=p.k_quant_type,
        v_quant="NONE" if p.is_latent else p.v_quant_type,
        opset=opset,
        fused_decode=fused and unfused is None and not if_free,
        rope_table_folded=rotary and _foldable_rope(node, types, constants, p.rotary_dim),
        if_free=if_free,
    )


def fused_decode_reason(p: PagedAttentionParams, *, has_sink: bool) -> str | None:
    """Why decodes of a node with parameters ``p`` cannot attend through ``com.microsoft::MultiHeadAttention``,
    or ``None`` when they can. The op has one softmax over masked scores: no softcap (applied before the mask) and
    no sink (an extra term in the denominator). LATENT reads V as a prefix of K, which the op has no form for."""
    if p.is_latent:
        return "LATENT layout: V is a prefix of the cached row"
    if p.softcap > 0:
        return f"softcap={p.softcap}: MultiHeadAttention has no softcap"
    if has_sink:
        return "head_sink: MultiHeadAttention has no attention sink"
    return None


def _dim(shape: tuple | None, i: int) -> int | None:
    if shape is None or len(shape) <= i:
        return None
    return shape[i]


@dataclass
class LayerCall:
    """One PagedAttention node as the function call that replaces it: the layer's configuration and the call's
    inputs and outputs (the plan's outputs are appended by :func:`lower_nodes`)."""

    node: onnx.NodeProto
    cfg: PortableConfig
    inputs: list[str]
    outputs: list[str]
    extra: list[str] = field(default_factory=list)  # a folded trailing write's (index, rows), after the plan's


def layer_call(
    node: onnx.NodeProto,
    types: Mapping[str, onnx.TypeProto],
    opset: int = DEFAULT_OPSET,
    folded: Mapping[str, onnx.NodeProto] | None = None,
    *,
    fused: bool = True,
    constants: Collection[str] = (),
    configure: Callable[[PortableConfig], PortableConfig] | None = None,
    if_free: bool = False,
) -> LayerCall:
    """``node`` as a call of its layer function: its present inputs in schema order, its present outputs
    (``fused``, ``constants``, ``if_free``: see :func:`portable_config`). ``folded``
    (:func:`ortpa.ops.trailing_write.trailing_writes`): a LATENT node whose ``key_cache_out`` gets more rows by a
    ``ScatterND`` writes them itself, and its call outputs that ``ScatterND``'s output. ``configure`` maps the
    validated configuration to the one the function is built with (see :func:`lower_to_portable`)."""
    cfg = portable_config(node, types, opset, fused=fused, constants=constants, if_free=if_free)
    if configure is not None:
        cfg = configure(cfg)
    inputs = [node.input[_INDEX[name]] for name in cfg.present_inputs]
    call = LayerCall(node, cfg, inputs, [o for o in node.output if o])
    scatter = (folded or {}).get(node.output[1]) if len(node.output) > 1 else None
    if scatter is not None and cfg.latent:
        call.cfg = replace(cfg, extra_write=True)
        call.extra = [scatter.input[1], scatter.input[2]]
        call.outputs = [scatter.output[0] if o == node.output[1] else o for o in call.outputs]
    return call


def lower_nodes(
    model: onnx.ModelProto,
    make_call: Callable[[int, onnx.NodeProto], LayerCall | None],
    types: Mapping[str, onnx.TypeProto],
) -> list[LayerCall]:
    """Replace in ``model`` (in place) each PagedAttention node by the call ``make_call(index, node)`` returns (None:
    the node stays), each layer's plan call placed before the first layer that uses it; add the functions and
    their domain. The one lowering loop of :func:`lower_to_portable` and of ``convert --portable``
    (:func:`ortpa.deploy.portable_file.lower_file`), which differ only in how a node becomes a call."""
    functions: dict[PortableConfig | PlanConfig, onnx.FunctionProto] = {}
    plans: dict[tuple, list[str]] = {}  # sharing key -> the plan call's output names
    calls: list[LayerCall] = []
    nodes: list[onnx.NodeProto] = []
    written: set[str] = set()  # key_cache_out values whose trailing ScatterND a call took over
    for i, node in enumerate(model.graph.node):
        if node.op_type == "ScatterND" and node.input and node.input[0] in written:
            continue
        call = make_call(i, node) if node.op_type == OP_TYPE and node.domain == DOMAIN else None
        if call is None:
            nodes.append(node)
            continue
        if call.extra:
            written.add(node.output[1])
        plan_node, plan_outputs = plan_call(node, call.cfg, types, plans, functions)
        if plan_node is not None:
            nodes.append(plan_node)
        nodes.append(
            helper.make_node(
                call.cfg.function_name(),
                [*call.inputs, *plan_outputs, *call.extra],
                call.outputs,
                name=node.name,
                domain=FUNCTION_DOMAIN,
            )
        )
        calls.append(call)
    if any(c.extra for c in calls):  # a folded write's rows are computed after the node it joins
        nodes = _topological(nodes)
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.functions.extend(functions.values())
    domains = {o.domain for o in model.opset_import}
    if functions and FUNCTION_DOMAIN not in domains:
        model.opset_import.append(helper.make_opsetid(FUNCTION_DOMAIN, 1))
    if any(isinstance(c, PortableConfig) and c.fused_decode for c in functions) and ORT_DOMAIN not in domains:
        model.opset_import.append(helper.make_opsetid(ORT_DOMAIN, 1))
    return calls


def lower_to_portable(
    model: onnx.ModelProto,
    node_names: Collection[str] | None = None,
    *,
    types: Mapping[str, onnx.TypeProto] | None = None,
    fused: bool = True,
    configure: Callable[[PortableConfig], PortableConfig] | None = None,
    if_free: bool = False,
) -> onnx.ModelProto:
    """A copy of ``model`` whose (selected) PagedAttention nodes call portable local functions.

    ``node_names`` selects nodes by name (``None``: all). Raises :class:`~ortpa.errors.InvalidArgument` for a
    node ONNX Runtime would reject and :class:`~ortpa.errors.NotImplementedByBackend` for an unsupported mode;
    ``model`` is never mutated. ``types`` (:func:`value_types` of the model after shape inference) spares a
    second shape inference when the caller ran one. ``fused`` (default): decodes attend through ONNX Runtime's
    ``com.microsoft::MultiHeadAttention`` where it computes the op's semantics (see :func:`portable_config`);
    ``False`` emits standard ONNX ops only. ``configure`` maps each node's validated configuration to
    the one its function is built with (verification's float32 twin, :mod:`ortpa.parity.twin`: T and caches in
    float32, which the op's own type rules do not allow and the portable graph computes anyway). ``if_free``:
    no ``If`` anywhere (``PortableConfig.if_free``: both groups at every step, padded so nothing is empty), for
    compilers that refuse ``If`` bodies such as OpenVINO's.
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    opsets = {o.domain: o.version for o in out.opset_import}
    main_opset = opsets.get("", opsets.get("ai.onnx", 0))
    if main_opset < _MIN_OPSET:
        raise NotImplementedByBackend(
            BACKEND,
            f"default-domain opset {main_opset}",
            f"expected a model importing opset >= {_MIN_OPSET} of the default domain, found {main_opset}",
        )
    # the function imports the model's own default-domain version, as local functions must
    fn_opset = main_opset
    types = _value_infos(out) if types is None else types
    wanted = None if node_names is None else set(node_names)
    constants = _constant_values(out.graph)

    folded = trailing_writes(out.graph)

    def make_call(_: int, node: onnx.NodeProto) -> LayerCall | None:
        if wanted is not None and node.name not in wanted:
            return None
        return layer_call(
            node, types, fn_opset, folded, fused=fused, constants=constants, configure=configure, if_free=if_free
        )

    lower_nodes(out, make_call, types)
    if wanted is not None:
        missing = wanted - {n.name for n in out.graph.node if n.domain == FUNCTION_DOMAIN}
        if missing:
            raise ValueError(f"node_names: expected PagedAttention node names, found unknown {sorted(missing)}")
    return out


# Ops whose output is a constant when their inputs are: a converter casts the model's cos/sin tables to the op's T
# in the graph (`Cast` of an initializer), which ONNX Runtime folds at session creation like the initializer itself
_FOLDED_OPS = frozenset({"Cast", "Identity"})


def _constant_values(graph: onnx.GraphProto) -> set[str]:
    """Names whose values ONNX Runtime knows at session creation: initializers, ``Constant`` outputs, and what
    :data:`_FOLDED_OPS` compute from them alone (nodes in topological order, as a valid graph lists them)."""
    overridable = {i.name for i in graph.input}  # an initializer that is also an input is fed at run time
    constants = {i.name for i in graph.initializer} - overridable
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            continue
        if node.op_type == "Constant" or (
            node.op_type in _FOLDED_OPS and node.input and all(i in constants for i in node.input if i)
        ):
            constants.update(o for o in node.output if o)
    return constants


# The largest float32 RoPE table (every position's cos and signed sin per rotated channel, 4x the bytes of float16
# cos + sin) a layer may fold into a constant; past it the rows are gathered per step (two kernels more per layer)
_MAX_FOLDED_ROPE_BYTES = 32 << 20


def _foldable_rope(
    node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], constants: Collection[str], rd: int
) -> bool:
    """Whether ``node``'s cos/sin caches are constants (initializers, or casts of them) whose folded float32 table
    stays small (see :data:`_MAX_FOLDED_ROPE_BYTES`)."""
    idx = {name: k for k, name in enumerate(n.name for n in PAGED_ATTENTION.inputs)}
    names = [node.input[idx[n]] if idx[n] < len(node.input) else "" for n in ("cos_cache", "sin_cache")]
    if not all(n in constants for n in names):
        return False
    rows = _dim(_tensor_info(types.get(names[0])).shape, 0)
    return rows is not None and rows * 2 * rd * 4 <= _MAX_FOLDED_ROPE_BYTES


def plan_call(
    node: onnx.NodeProto,
    cfg: PortableConfig,
    types: Mapping[str, onnx.TypeProto],
    plans: dict[tuple, list[str]],
    functions: dict,
) -> tuple[onnx.NodeProto | None, list[str]]:
    """The per-step plan a lowered layer ``node`` (configuration ``cfg``) takes: ``(a new plan call to place before
    the layer, or None when an earlier layer's is shared; the plan output names to append to the layer call's
    inputs)``. ``plans`` (sharing key -> output names) and ``functions`` (config -> FunctionProto, the layer's own
    function added here too) carry what earlier layers made."""
    if cfg not in functions:
        functions[cfg] = ir.serde.serialize_function(build_function(cfg))
    plan = PlanConfig.of(cfg)
    plan_inputs = [node.input[_INDEX[name]] for name in plan.inputs]
    key = _plan_key(plan, plan_inputs, types, node.name)
    if key in plans:
        return None, plans[key]
    # placed before the first layer that uses it: its inputs (this layer's query included) exist there
    if plan not in functions:
        functions[plan] = ir.serde.serialize_function(build_plan_function(plan))
    names = [f"{node.name}/plan/{o}" for o in PLAN_OUTPUTS]
    plans[key] = names
    plan_node = helper.make_node(
        plan.function_name(), plan_inputs, names, name=f"{node.name}/plan", domain=FUNCTION_DOMAIN
    )
    return plan_node, names


def _plan_key(plan: PlanConfig, inputs: list[str], types: Mapping[str, onnx.TypeProto], node: str) -> tuple:
    """Layers share one plan call when they pass the same index inputs and their token count (query dim 0) and
    cache dims (key_cache dims 0 and 1) are declared the same (one symbol or one value); else a plan per layer."""
    dims = []
    for name, axes in ((inputs[0], (0,)), (inputs[1], (0, 1))):
        shape = _tensor_info(types.get(name)).shape
        sym = None
        tt = types.get(name)
        if shape is not None and tt is not None:
            sym = tuple(
                (d.dim_param or None) if not d.HasField("dim_value") else d.dim_value
                for d in (tt.tensor_type.shape.dim[a] for a in axes)
            )
        if sym is None or None in sym:
            return (plan, node)  # unknown: this layer's own plan
        dims.append(sym)
    return (plan, tuple(inputs[2:]), tuple(dims))


def _topological(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """``nodes`` in an order where each comes after the producers of what it reads (subgraphs' outer values
    included), otherwise in their given order (Kahn's algorithm, the lowest index first)."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output if o}
    needs: list[set[int]] = []
    for k, n in enumerate(nodes):
        deps = {producer[i] for i in _reads(n) if i in producer}
        deps.discard(k)
        needs.append(deps)
    users: dict[int, list[int]] = {}
    for k, deps in enumerate(needs):
        for d in deps:
            users.setdefault(d, []).append(k)
    waiting = [len(deps) for deps in needs]
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[onnx.NodeProto] = []
    while ready:
        k = heapq.heappop(ready)
        order.append(nodes[k])
        for u in users.get(k, []):
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(order) != len(nodes):  # a cycle: leave the graph as it was for the checker to name
        return nodes
    return order


def _reads(node: onnx.NodeProto) -> set[str]:
    """The values ``node`` reads: its inputs, and what its subgraphs read from outside them."""
    names = {i for i in node.input if i}
    for attr in node.attribute:
        for graph in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            inner = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
            inner |= {i.name for i in graph.initializer}
            for n in graph.node:
                names |= _reads(n) - inner
    return names
