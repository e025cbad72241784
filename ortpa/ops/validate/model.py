"""Validate every ``com.microsoft::PagedAttention`` node of a model from its declared types and shapes.

:func:`validate_model` loads the model safely, runs ONNX shape inference when it can, and for each node
applies, in ONNX Runtime's order: type binding, the schema's shape-inference rules (``schema.*``, reference
§2.3), the kernel's input checks (:func:`ortpa.ops.validate.check_inputs`) and, when asked, a backend gate
(:func:`ortpa.ops.backends.check_backend`). A rule that needs a symbolic dimension is reported as
unchecked, never as passed; unchecked rules do not make the report fail.

The model-level half of :mod:`ortpa.ops.validate` (the rule modules beside it judge one node's inputs); it
imports them, they never import it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from ortpa.errors import InvalidArgument, NotImplementedByBackend
from ortpa.model.file import read_model
from ortpa.model.ref import resolve_any
from ortpa.ops.backends import BACKENDS, available_backends, check_backend
from ortpa.ops.shape_inference import infer_shapes
from ortpa.ops.spec import DOMAIN, OP_TYPE, PAGED_ATTENTION
from ortpa.ops.validate.checks import TensorInfo
from ortpa.ops.validate.inputs import check_inputs
from ortpa.ops.validate.signature import check_signature, check_types

__all__ = [
    "SCHEMA_RULES",
    "NodeReport",
    "ValidationReport",
    "check_schema",
    "load_model",
    "validate",
    "validate_backends",
    "validate_model",
]

SCHEMA_RULES: dict[str, str] = {
    "schema.layout": "kv_cache_layout is 'SEPARATE' or 'LATENT'",
    "schema.query_rank": "query is 2-D",
    "schema.latent.num_heads": "LATENT: num_heads is positive",
    "schema.latent.divisible": "LATENT with v_head_size: query hidden size is divisible by num_heads",
    "schema.latent.v_head_size": "LATENT: v_head_size does not exceed head_size",
    "schema.packed.heads": "value absent (SEPARATE): hidden size concrete and positive, num_heads > 0, "
    "kv_num_heads >= 0 (a symbolic hidden size fails, as in ONNX Runtime)",
    "schema.packed.divisible": "value absent (SEPARATE): hidden size divisible by num_heads + 2 kv_num_heads",
    "schema.outputs.latent": "LATENT: value_cache_out is absent",
    "schema.outputs.both": "SEPARATE: key_cache_out and value_cache_out both present or both absent",
    "schema.outputs.value_cache": "value_cache_out needs value_cache",
    "schema.key_cache_rank": "with cache outputs, key_cache is 4-D",
}


# ------------------------------------------------------------------------------------------ loading
def load_model(model: Any) -> tuple[onnx.ModelProto, str]:
    """A ModelProto and a label from a path, bytes, ModelProto or onnx_ir.Model; :class:`InvalidModel` if
    unreadable. One loader for every command: see :func:`ortpa.model.file.read_model` for what is checked.

    Validation is static: it neither modifies the model (no copy), nor reads weights (external references are
    checked, not followed), nor needs ONNX Runtime to load its ir_version / opsets (helper.make_model stamps an
    ir_version newer than some ORT releases accept).
    """
    loaded = read_model(model, copy=False, check_runtime=False, load_external_data=False)
    return loaded.proto, loaded.label


# ------------------------------------------------------------------------------------------ types
def _value_types(graph: onnx.GraphProto, outer: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    types = dict(outer)
    for init in graph.initializer:
        types[init.name] = TensorInfo(tuple(init.dims), init.data_type)
    for vi in (*graph.input, *graph.value_info, *graph.output):
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type"):
            continue
        shape = None
        if t.HasField("shape"):
            shape = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim)
        types[vi.name] = TensorInfo(shape, t.elem_type or None)
    return types


def _walk(graph: onnx.GraphProto, prefix: str, outer: Mapping[str, TensorInfo]) -> Iterator[tuple]:
    """(qualified name, node, value types) of every PagedAttention node, subgraphs included."""
    types = _value_types(graph, outer)
    for i, node in enumerate(graph.node):
        label = prefix + (node.name or f"<{node.op_type} #{i}>")
        if node.op_type == OP_TYPE and node.domain == DOMAIN:
            yield label, node, types
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
            for sub in subs:
                yield from _walk(sub, f"{label}/{attr.name}/", types)


def _attrs(node: onnx.NodeProto) -> dict[str, Any]:
    out = {}
    for a in node.attribute:
        value = onnx.helper.get_attribute_value(a)
        out[a.name] = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    return out


# ------------------------------------------------------------------------------------------ schema §2.3
def _int_attr(attrs: Mapping[str, Any], name: str, default: int) -> int:
    v = attrs.get(name, default)
    return v if isinstance(v, int) else default


def check_schema(
    inputs: Mapping[str, Any], attrs: Mapping[str, Any], num_outputs: int, *, node: str | None = None
) -> None:
    """ONNX Runtime's ``PagedAttentionTypeAndShapeInference`` rules (§2.3) on declared shapes.

    ``num_outputs`` counts the node's output slots as ONNX Runtime does (trailing empty names included).
    """

    def fail(rule: str, name: str, message: str) -> None:
        raise InvalidArgument(rule, name, f"[ShapeInferenceError] {message}", node=node)

    layout = attrs.get("kv_cache_layout", "SEPARATE")
    if layout not in ("SEPARATE", "LATENT"):
        fail("schema.layout", "kv_cache_layout", "kv_cache_layout must be 'SEPARATE' or 'LATENT'.")
    latent = layout == "LATENT"
    nh, kvh = _int_attr(attrs, "num_heads", 0), _int_attr(attrs, "kv_num_heads", 0)
    q = inputs.get("query")
    q_shape = None if q is None else getattr(q, "shape", None)
    if q_shape is not None:
        q_shape = tuple(q_shape)
        if len(q_shape) != 2:
            fail("schema.query_rank", "query", "Input 0 (query) shall be 2 dimensions")
        dim1 = q_shape[1]
        hidden = dim1 if isinstance(dim1, int) and dim1 > 0 else 0  # dim_value(): 0 when symbolic
        v_head = _int_attr(attrs, "v_head_size", 0)
        if latent:
            if nh <= 0:
                fail("schema.latent.num_heads", "num_heads", "num_heads must be a positive integer.")
            if v_head != 0 and hidden > 0:
                if hidden % nh:
                    fail("schema.latent.divisible", "query", "Query hidden size must be divisible by num_heads.")
                if v_head > hidden // nh:
                    fail("schema.latent.v_head_size", "v_head_size", "v_head_size must not exceed head_size.")
        elif inputs.get("value") is None:
            if hidden <= 0 or nh <= 0 or kvh < 0:
                fail(
                    "schema.packed.heads",
                    "query",
                    "Invalid hidden size or number of heads. Hidden size, num_heads and kv_num_heads must be "
                    "positive integers.",
                )
            if hidden % (nh + 2 * kvh):
                fail(
                    "schema.packed.divisible",
                    "query",
                    "Hidden size must be divisible by (num_heads + 2 * kv_num_heads).",
                )
    if num_outputs > 1:
        if latent:
            if num_outputs > 2:
                fail(
                    "schema.outputs.latent",
                    "value_cache_out",
                    "value_cache_out must be absent when kv_cache_layout is 'LATENT'.",
                )
        elif num_outputs != 3:
            fail(
                "schema.outputs.both",
                "key_cache_out",
                "Key cache and value cache output tensors must be both present or both absent.",
            )
        elif inputs.get("value_cache") is None:
            fail(
                "schema.outputs.value_cache", "value_cache", "value_cache is required when value_cache_out is present."
            )
        kc = inputs.get("key_cache")
        kc_shape = None if kc is None else getattr(kc, "shape", None)
        if kc_shape is None:  # getInputShape(ctx, 3): a cache output needs key_cache's shape declared
            fail("schema.key_cache_rank", "key_cache", "Input 3 must have a non null shape in .")
        if len(tuple(kc_shape)) != 4:
            fail("schema.key_cache_rank", "key_cache", "The block-based KV cache inputs shall be 4 dimensions")


# ------------------------------------------------------------------------------------------ report
@dataclass(frozen=True)
class NodeReport:
    """One node: ``status`` is "valid", "unchecked" (valid as far as known), "invalid" or "unsupported"."""

    node: str
    status: str
    errors: tuple[tuple[str, str, str], ...] = ()  # (rule, name, message)
    unchecked: tuple[tuple[str, str], ...] = ()  # (rule, reason)
    backend_errors: tuple[tuple[str, str, str], ...] = ()  # (backend, feature, detail)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "status": self.status,
            "errors": [{"rule": r, "name": n, "message": m} for r, n, m in self.errors],
            "unchecked": [{"rule": r, "reason": why} for r, why in self.unchecked],
            "backend_errors": [{"backend": b, "feature": f, "detail": d} for b, f, d in self.backend_errors],
            "notes": list(self.notes),
        }


@dataclass(frozen=True)
class ValidationReport:
    source: str
    backend: str | None
    nodes: tuple[NodeReport, ...]
    warnings: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """False if any node is invalid or fails the backend gate; unchecked rules never fail."""
        return all(n.status in ("valid", "unchecked") for n in self.nodes)

    def format(self) -> str:
        head = f"{self.source}: " + (
            "no PagedAttention nodes" if not self.nodes else f"{len(self.nodes)} PagedAttention node(s)"
        )
        if self.backend:
            head += f", backend {self.backend}"
        lines = [head]
        lines += [f"  warning: {w}" for w in self.warnings]
        for n in self.nodes:
            lines.append(f"  {n.node}: {n.status}")
            lines += [f"    error [{r}] {name}: {msg}" for r, name, msg in n.errors]
            lines += [f"    not implemented by {b}: {f}: {d}" for b, f, d in n.backend_errors]
            lines += [f"    unchecked [{r}]: {why}" for r, why in n.unchecked]
            lines += [f"    note: {note}" for note in n.notes]
        lines.append("OK" if self.ok else "INVALID")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "backend": self.backend,
            "ok": self.ok,
            "summary": "no PagedAttention nodes" if not self.nodes else f"{len(self.nodes)} PagedAttention node(s)",
            "warnings": list(self.warnings),
            "nodes": [n.to_dict() for n in self.nodes],
        }


def _check_node(label: str, node: onnx.NodeProto, types: Mapping[str, TensorInfo], backend: str | None) -> NodeReport:
    mtpb = BACKENDS[backend].max_threads_per_block if backend else 1024
    report, params, cache_outputs = _check_rules(label, node, types, mtpb)
    return _gate(report, params, cache_outputs, backend)


def _check_rules(
    label: str, node: onnx.NodeProto, types: Mapping[str, TensorInfo], mtpb: int
) -> tuple[NodeReport, Any, tuple[bool, bool]]:
    """ONNX Runtime's rules for one node: its report, its parameters (None when invalid), its cache outputs."""
    names = list(node.input)
    inputs: dict[str, Any] = {}
    for formal, actual in zip(PAGED_ATTENTION.input_names, names, strict=False):
        if actual:
            inputs[formal] = types.get(actual, TensorInfo(None, None))
    attrs = _attrs(node)
    unchecked: list = []
    outs = list(node.output)
    cache_outputs = (len(outs) > 1 and bool(outs[1]), len(outs) > 2 and bool(outs[2]))
    try:
        attr_types = {a.name: onnx.AttributeProto.AttributeType.Name(a.type) for a in node.attribute}
        check_signature(names, outs, attr_types, node=label)
        check_types(inputs, node=label, unchecked=unchecked)
        check_schema(inputs, attrs, len(outs), node=label)
        check_inputs(inputs, attrs, node=label, max_threads_per_block=mtpb, unchecked=[])
    except InvalidArgument as exc:
        report = NodeReport(label, "invalid", errors=((exc.rule, exc.name, exc.message),), unchecked=_dedup(unchecked))
        return report, None, cache_outputs
    # check_inputs repeats the type rules: collect its unchecked list once, from a clean run
    unchecked = []
    params = check_inputs(inputs, attrs, node=label, max_threads_per_block=mtpb, unchecked=unchecked)
    status = "unchecked" if unchecked else "valid"
    return NodeReport(label, status, unchecked=_dedup(unchecked)), params, cache_outputs


def _gate(report: NodeReport, params: Any, cache_outputs: tuple[bool, bool], backend: str | None) -> NodeReport:
    """``report`` (the rules) with ``backend``'s feature gate applied; invalid nodes stay as they are."""
    if backend is None or params is None:
        return report
    try:
        notes = check_backend(params, {"cache_outputs": cache_outputs}, backend, node=report.node)
    except NotImplementedByBackend as exc:
        return NodeReport(
            report.node,
            "unsupported",
            unchecked=report.unchecked,
            backend_errors=((exc.backend, exc.feature, exc.detail),),
        )
    return NodeReport(report.node, report.status, unchecked=report.unchecked, notes=notes)


def _dedup(items: list) -> tuple:
    return tuple(dict.fromkeys(items))


def validate_model(model: Any, backend: str | None = None, revision: str | None = None) -> ValidationReport:
    """Validate every PagedAttention node of ``model`` (a path, a folder or Hugging Face repo id in the local
    cache with its ``revision``, bytes or ``onnx.ModelProto``).

    Raises :class:`InvalidModel` when the model cannot be read; everything about the nodes is in the report.
    """
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {available_backends()}")
    proto, source = load_model(resolve_any(model, revision))
    proto, warnings = _inferred(proto)
    nodes = [_check_node(label, node, types, backend) for label, node, types in _all_nodes(proto)]
    return ValidationReport(source, backend, tuple(nodes), warnings)


def validate_backends(
    model: Any, backends: Sequence[str], *, shapes_inferred: bool = False
) -> dict[str | None, ValidationReport]:
    """One report without a backend gate (key ``None``) and one per backend in ``backends``, from a single
    shape inference and a single check of each node's rules (sessions need all three; they used to cost three
    validations and three shape inferences). ``shapes_inferred``: the caller ran shape inference already."""
    for backend in backends:
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; expected one of {available_backends()}")
    proto, source = load_model(model)
    proto, warnings = (proto, ()) if shapes_inferred else _inferred(proto)
    nodes: dict[str | None, list[NodeReport]] = {None: [], **{b: [] for b in backends}}
    for label, node, types in _all_nodes(proto):
        report, params, cache_outputs = _check_rules(label, node, types, 1024)
        nodes[None].append(report)
        for backend in backends:
            # the rules ran with CUDA's thread limit (rule 1.1.1); a backend with another limit re-checks them
            if BACKENDS[backend].max_threads_per_block in (0, 1024):
                nodes[backend].append(_gate(report, params, cache_outputs, backend))
            else:
                nodes[backend].append(_check_node(label, node, types, backend))
    return {b: ValidationReport(source, b, tuple(n), warnings) for b, n in nodes.items()}


def _inferred(proto: onnx.ModelProto) -> tuple[onnx.ModelProto, tuple[str, ...]]:
    try:
        # shape inference fills value_info for intermediate values; com.microsoft ops it does not know are skipped
        return infer_shapes(proto, strict=True), ()
    except Exception as exc:  # a model it cannot handle (> 2 GB, unknown ops in strict paths) keeps its declared types
        return proto, (f"onnx shape inference failed ({type(exc).__name__}); using declared value_info only",)


def _all_nodes(proto: onnx.ModelProto) -> Iterator[tuple]:
    yield from _walk(proto.graph, "", {})
    for fn in proto.functions:
        yield from _walk(_fn_graph(fn), f"{fn.name}/", {})


def _fn_graph(fn: onnx.FunctionProto) -> onnx.GraphProto:
    """A function body as a graph without types: its inputs are checked as unknown shapes."""
    g = onnx.GraphProto()
    g.node.extend(fn.node)
    g.value_info.extend(getattr(fn, "value_info", []))
    return g


validate = validate_model
