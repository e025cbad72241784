"""The ``com.microsoft::PagedAttention`` schema (ONNX Runtime 1.31/1.32) as plain data.

``tests/ops/test_spec.py`` compares this, field by field, with the schema registered in the installed
onnxruntime, so a change upstream shows up as a readable diff instead of a silently wrong model.

Two kinds of defaults exist: ``schema_default`` is what the registered schema declares (``None`` where it
declares none), ``kernel_default`` is what the kernels use when the attribute is absent (reference §2.1).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

__all__ = [
    "DOMAIN",
    "OP_TYPE",
    "PAGED_ATTENTION",
    "AttributeSpec",
    "FormalSpec",
    "OpSpec",
    "TypeConstraintSpec",
]

DOMAIN = "com.microsoft"
OP_TYPE = "PagedAttention"

AttrType = Literal["INT", "FLOAT", "STRING"]


@dataclass(frozen=True)
class AttributeSpec:
    name: str
    type: AttrType
    required: bool
    schema_default: int | float | str | None
    kernel_default: int | float | str | None


@dataclass(frozen=True)
class FormalSpec:
    """One input or output: its position, name, type parameter and whether it may be omitted."""

    index: int
    name: str
    type_param: str
    optional: bool


@dataclass(frozen=True)
class TypeConstraintSpec:
    param: str
    allowed: tuple[str, ...]


@dataclass(frozen=True)
class OpSpec:
    domain: str
    op_type: str
    since_version: int
    attributes: tuple[AttributeSpec, ...]
    inputs: tuple[FormalSpec, ...]
    outputs: tuple[FormalSpec, ...]
    type_constraints: tuple[TypeConstraintSpec, ...]

    @property
    def attribute_map(self) -> Mapping[str, AttributeSpec]:
        return MappingProxyType({a.name: a for a in self.attributes})

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.outputs)

    def input_index(self, name: str) -> int:
        for i in self.inputs:
            if i.name == name:
                return i.index
        raise KeyError(f"{self.op_type} has no input named {name!r}; inputs are {self.input_names}")

    def allowed_types(self, type_param: str) -> tuple[str, ...]:
        for tc in self.type_constraints:
            if tc.param == type_param:
                return tc.allowed
        raise KeyError(f"{self.op_type} has no type parameter {type_param!r}")

    def kernel_defaults(self) -> dict[str, int | float | str]:
        """Attribute values the kernels use when an optional attribute is absent."""
        return {a.name: a.kernel_default for a in self.attributes if a.kernel_default is not None}


_A = AttributeSpec
_ATTRIBUTES = (
    _A("num_heads", "INT", True, None, None),
    _A("kv_num_heads", "INT", True, None, None),
    _A("scale", "FLOAT", False, None, 0.0),
    _A("softcap", "FLOAT", False, None, 0.0),
    _A("local_window_size", "INT", False, -1, -1),
    _A("is_causal", "INT", False, 1, 1),
    _A("do_rotary", "INT", False, None, 0),
    _A("rotary_interleaved", "INT", False, None, 0),
    _A("qk_norm_epsilon", "FLOAT", False, None, 1e-6),
    _A("k_quant_type", "STRING", False, "NONE", "NONE"),
    _A("v_quant_type", "STRING", False, "NONE", "NONE"),
    _A("k_cache_dtype", "STRING", False, "", ""),
    _A("v_cache_dtype", "STRING", False, "", ""),
    _A("kv_cache_layout", "STRING", False, "SEPARATE", "SEPARATE"),
    _A("v_head_size", "INT", False, None, 0),
    _A("rotary_offset", "INT", False, None, 0),
)

_INPUTS = tuple(
    FormalSpec(i, name, tp, opt)
    for i, (name, tp, opt) in enumerate(
        [
            ("query", "T", False),
            ("key", "T", True),
            ("value", "T", True),
            ("key_cache", "T_CACHE", False),
            ("value_cache", "T_CACHE", True),
            ("cumulative_sequence_length", "S", False),
            ("past_seqlens", "S", False),
            ("block_table", "S", False),
            ("cos_cache", "T", True),
            ("sin_cache", "T", True),
            ("slot_mapping", "S", True),
            ("head_sink", "T", True),
            ("q_norm_weight", "T", True),
            ("k_norm_weight", "T", True),
            ("k_scale", "T_KV_SCALE", True),
            ("v_scale", "T_KV_SCALE", True),
            ("attention_metadata", "S", True),
        ]
    )
)

_OUTPUTS = (
    FormalSpec(0, "output", "T", False),
    FormalSpec(1, "key_cache_out", "T_CACHE", True),
    FormalSpec(2, "value_cache_out", "T_CACHE", True),
)

_TYPE_CONSTRAINTS = (
    TypeConstraintSpec("T", ("tensor(float16)", "tensor(bfloat16)")),
    TypeConstraintSpec(
        "T_CACHE",
        ("tensor(float16)", "tensor(bfloat16)", "tensor(int8)", "tensor(float8e4m3fn)", "tensor(uint8)"),
    ),
    TypeConstraintSpec("T_KV_SCALE", ("tensor(float)",)),
    TypeConstraintSpec("S", ("tensor(int32)",)),
)

PAGED_ATTENTION = OpSpec(
    domain=DOMAIN,
    op_type=OP_TYPE,
    since_version=1,
    attributes=_ATTRIBUTES,
    inputs=_INPUTS,
    outputs=_OUTPUTS,
    type_constraints=_TYPE_CONSTRAINTS,
)
