"""What ONNX Runtime's own schema registry says a model may contain.

onnx knows only the ONNX standard; the models people have (onnxruntime-genai's builder, ORT-fused exports) also
use ops that ONNX Runtime registers itself: contrib ops in ``com.microsoft`` (``GroupQueryAttention``,
``MatMulNBits``, ``RotaryEmbedding``, ...) and a few in the *default* domain that are not ONNX ops
(``SimplifiedLayerNormalization``). A file ONNX Runtime runs must not be refused because onnx does not know an
op, so the loader asks this registry (:func:`ort_schema`) after onnx's.

:func:`register_ort_default_domain_schemas` teaches onnx's checker and shape inference the default-domain ops
only ONNX Runtime knows (once per process, idempotent): without it ``onnx.checker`` rejects such a model and
shape inference stops at the first such node. It is called by the loader, not at import.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import onnx
import onnx.defs

__all__ = ["OrtSchema", "ort_schema", "register_ort_default_domain_schemas"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OrtSchema:
    """The arity of one op version in ONNX Runtime's registry."""

    domain: str
    name: str
    since_version: int
    min_input: int
    max_input: int
    min_output: int
    max_output: int


@functools.lru_cache(maxsize=1)
def _registry() -> dict[tuple[str, str], list]:
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    table: dict[tuple[str, str], list] = {}
    for schema in C.get_all_operator_schema():
        table.setdefault((schema.domain, schema.name), []).append(schema)
    for versions in table.values():
        versions.sort(key=lambda s: s.since_version)
    return table


def _raw(domain: str, op_type: str, opset: int):
    domain = "" if domain in ("", "ai.onnx") else domain
    versions = [s for s in _registry().get((domain, op_type), []) if s.since_version <= opset]
    return versions[-1] if versions else None


def ort_schema(domain: str, op_type: str, opset: int) -> OrtSchema | None:
    """The newest version of ``domain::op_type`` at or below ``opset`` that ONNX Runtime registers, or None."""
    s = _raw(domain, op_type, opset)
    if s is None:
        return None
    return OrtSchema(s.domain, s.name, s.since_version, s.min_input, s.max_input, s.min_output, s.max_output)


def _same_as_input0(ctx) -> None:
    """Output 0 has input 0's type and shape (the normalisations: ``Y`` is shaped like ``X``)."""
    t = ctx.get_input_type(0)
    if t is not None:
        ctx.set_output_type(0, t)


_SHAPE_RULES = {"SimplifiedLayerNormalization": _same_as_input0}


@functools.lru_cache(maxsize=1)
def register_ort_default_domain_schemas() -> tuple[str, ...]:
    """Register with onnx every default-domain op ONNX Runtime knows and onnx does not; the names registered."""
    known = {s.name for s in onnx.defs.get_all_schemas_with_history() if s.domain == ""}
    fp = onnx.defs.OpSchema.FormalParameter
    opt = onnx.defs.OpSchema.FormalParameterOption
    attr_types = {
        "INT": onnx.defs.OpSchema.AttrType.INT,
        "FLOAT": onnx.defs.OpSchema.AttrType.FLOAT,
        "STRING": onnx.defs.OpSchema.AttrType.STRING,
        "INTS": onnx.defs.OpSchema.AttrType.INTS,
        "FLOATS": onnx.defs.OpSchema.AttrType.FLOATS,
        "STRINGS": onnx.defs.OpSchema.AttrType.STRINGS,
        "TENSOR": onnx.defs.OpSchema.AttrType.TENSOR,
    }
    options = {"Single": opt.Single, "Optional": opt.Optional, "Variadic": opt.Variadic}
    registered = []
    for (domain, name), versions in sorted(_registry().items()):
        if domain != "" or name in known:
            continue
        for s in versions:
            try:
                schema = onnx.defs.OpSchema(
                    name,
                    "",
                    s.since_version,
                    "ONNX Runtime op outside the ONNX standard (registered by ortpa from ORT's registry)",
                    inputs=[fp(p.name, p.typeStr, param_option=options[p.option.name]) for p in s.inputs],
                    outputs=[fp(p.name, p.typeStr, param_option=options[p.option.name]) for p in s.outputs],
                    type_constraints=[(t.type_param_str, list(t.allowed_type_strs), "") for t in s.type_constraints],
                    attributes=[
                        onnx.defs.OpSchema.Attribute(k, attr_types[a.type.name], required=bool(a.required))
                        for k, a in s.attributes.items()
                        if a.type.name in attr_types
                    ],
                )
                if name in _SHAPE_RULES:
                    schema.set_type_and_shape_inference_function(_SHAPE_RULES[name])
                onnx.defs.register_schema(schema)
            except Exception as exc:  # an ORT schema onnx cannot express (never one a converted LLM uses): leave it out
                _log.debug("ONNX Runtime schema %s-%d not registered with onnx: %s", name, s.since_version, exc)
                continue
            registered.append(f"{name}-{s.since_version}")
    return tuple(registered)
