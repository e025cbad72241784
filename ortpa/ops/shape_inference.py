"""Teach ``onnx.shape_inference`` the type and shape rule of ``com.microsoft::PagedAttention``.

onnx's own shape inference does not know contrib ops, so in a converted model every tensor downstream of the
first PagedAttention node (the next layer's query included) would have no shape, and nothing that needs a
static head size (the portable lowering, the validator) could work on layers after the first. Registering
the op's schema, built from :mod:`ortpa.ops.spec`, with ONNX Runtime's inference rule (reference §2.3: output
``[tokens, num_heads * v_head_size]``, cache outputs shaped like the cache inputs) fixes that in one pass.

Global state: onnx keeps schemas in one process-wide registry. ortpa changes it in exactly one place,
:func:`register_schemas`, called by :func:`infer_shapes` and by the model loader's domain check, never at
import. It registers this op's schema and the default-domain ops only ONNX Runtime knows
(:func:`ortpa.model.ort_schemas.register_ort_default_domain_schemas`); both are idempotent (once per process, and
nothing when onnx already knows the op: a newer onnx, or another library that registered it).
"""

from __future__ import annotations

import functools
import logging

import onnx
import onnx.defs
from onnx import helper

from ortpa.model.ort_schemas import register_ort_default_domain_schemas
from ortpa.ops.spec import DOMAIN, OP_TYPE, PAGED_ATTENTION

__all__ = ["infer_shapes", "register_paged_attention_schema", "register_schemas"]

_log = logging.getLogger(__name__)

_ATTR_TYPES = {
    "INT": onnx.defs.OpSchema.AttrType.INT,
    "FLOAT": onnx.defs.OpSchema.AttrType.FLOAT,
    "STRING": onnx.defs.OpSchema.AttrType.STRING,
}


def _attr(ctx, name: str, default):
    a = ctx.get_attribute(name)
    return default if a is None else helper.get_attribute_value(a)


def _infer(ctx) -> None:
    query_type = ctx.get_input_type(0)
    if query_type is None or not query_type.HasField("tensor_type"):
        return
    q = query_type.tensor_type
    out = onnx.TypeProto()
    out.tensor_type.elem_type = q.elem_type
    if q.HasField("shape") and len(q.shape.dim) == 2:
        layout = _attr(ctx, "kv_cache_layout", b"SEPARATE")
        layout = layout.decode() if isinstance(layout, bytes) else layout
        num_heads = int(_attr(ctx, "num_heads", 0))
        kv_heads = int(_attr(ctx, "kv_num_heads", 0))
        v_head = int(_attr(ctx, "v_head_size", 0))
        tokens, hidden = q.shape.dim
        width = None
        if hidden.HasField("dim_value") and num_heads > 0:
            h = hidden.dim_value
            packed = layout != "LATENT" and not (ctx.has_input(1) and ctx.has_input(2))
            if packed and num_heads + 2 * kv_heads > 0:
                width = h // (num_heads + 2 * kv_heads) * num_heads
            elif layout == "LATENT" and v_head:
                width = num_heads * v_head
            else:
                width = h
        dims = out.tensor_type.shape.dim
        dims.add().CopyFrom(tokens)
        d = dims.add()
        if width is not None:
            d.dim_value = width
    ctx.set_output_type(0, out)
    for out_idx, in_idx in ((1, 3), (2, 4)):
        if ctx.get_num_outputs() > out_idx and ctx.has_output(out_idx) and ctx.has_input(in_idx):
            cache_type = ctx.get_input_type(in_idx)
            if cache_type is not None:
                ctx.set_output_type(out_idx, cache_type)


@functools.lru_cache(maxsize=1)
def register_paged_attention_schema() -> bool:
    """Register the schema with onnx (once per process); False when onnx already knows the op."""
    try:
        onnx.defs.get_schema(OP_TYPE, PAGED_ATTENTION.since_version, DOMAIN)
        return False
    except onnx.defs.SchemaError:
        pass
    fp = onnx.defs.OpSchema.FormalParameter
    opt = onnx.defs.OpSchema.FormalParameterOption
    schema = onnx.defs.OpSchema(
        OP_TYPE,
        DOMAIN,
        PAGED_ATTENTION.since_version,
        "ONNX Runtime contrib op (registered by ortpa for shape inference only)",
        inputs=[
            fp(i.name, i.type_param, param_option=opt.Optional if i.optional else opt.Single)
            for i in PAGED_ATTENTION.inputs
        ],
        outputs=[
            fp(o.name, o.type_param, param_option=opt.Optional if o.optional else opt.Single)
            for o in PAGED_ATTENTION.outputs
        ],
        type_constraints=[(tc.param, list(tc.allowed), "") for tc in PAGED_ATTENTION.type_constraints],
        attributes=[
            onnx.defs.OpSchema.Attribute(a.name, _ATTR_TYPES[a.type], required=a.required)
            for a in PAGED_ATTENTION.attributes
        ],
    )
    schema.set_type_and_shape_inference_function(_infer)
    onnx.defs.register_schema(schema)
    return True


def register_schemas() -> None:
    """Teach onnx's global schema registry what ortpa's models use (see the module docstring); idempotent."""
    register_paged_attention_schema()
    register_ort_default_domain_schemas()


def infer_shapes(model: onnx.ModelProto, *, strict: bool = False) -> onnx.ModelProto:
    """``onnx.shape_inference.infer_shapes`` that also propagates through PagedAttention nodes.

    When inference fails (a model > 2 GB, an op onnx rejects) the input model is returned unchanged, since
    the declared types are then all there is, unless ``strict`` asks for the exception.
    """
    register_schemas()
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception as exc:
        if strict:
            raise
        _log.debug("onnx shape inference failed, keeping the declared types: %s: %s", type(exc).__name__, exc)
        return model
