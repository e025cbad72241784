"""Attributes: parsing against the schema (``type.attribute``) and the kernel constructor's rules (``ctor.*``).

:func:`attr_value` turns one Python attribute value into the schema's type or fails with ONNX Runtime's
wording; :func:`check_constructor` reads every attribute with the kernel's default and enforces the
constructor's invariants (reference §1.0), returning the normalised attribute dict the later rules read.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ortpa.ops.spec import OP_TYPE, PAGED_ATTENTION, AttributeSpec
from ortpa.ops.validate.checks import Rules

__all__ = ["attr_spec", "attr_value", "check_attr_type", "check_constructor"]

_ATTR_SPECS = PAGED_ATTENTION.attribute_map
_QUANT_TYPES = ("NONE", "PER_TENSOR", "PER_CHANNEL")
_CACHE_DTYPES = ("", "float16", "bfloat16", "int8", "float8e4m3fn", "int4", "float4e2m1")


def attr_spec(name: str, r: Rules) -> AttributeSpec:
    """The schema's spec of attribute ``name``; an unknown name fails ``type.attribute``."""
    spec = _ATTR_SPECS.get(name)
    if spec is None:
        r.fail("type.attribute", name, f"Unrecognized attribute: {name} for operator {OP_TYPE}")
    return spec


def check_attr_type(spec: AttributeSpec, name: str, found: str, r: Rules) -> None:
    """``type.attribute``: the attribute's type name (INT, FLOAT, STRING, ...) is the schema's."""
    if found != spec.type:
        where = r.node or ""
        r.fail(
            "type.attribute",
            name,
            f"Mismatched attribute type in '{where} : {name}'. Expected: '{spec.type}', actual: '{found}'",
        )


def attr_value(name: str, value: Any, r: Rules) -> Any:
    """A Python attribute value as the schema's type (``type.attribute`` on an unknown name or wrong type)."""
    spec = attr_spec(name, r)
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    found = {bool: "INT", str: "STRING"}.get(type(value))
    if found is None:
        if isinstance(value, (int, np.integer)):
            found = "INT"
        elif isinstance(value, (float, np.floating)):
            found = "FLOAT"
        else:
            found = type(value).__name__
    if spec.type == "FLOAT" and found == "INT" and not isinstance(value, bool):
        return float(value)  # an int for a float attribute is harmless when built from Python
    check_attr_type(spec, name, found, r)
    return int(value) if spec.type == "INT" else float(value) if spec.type == "FLOAT" else value


def check_constructor(attrs: Mapping[str, Any], r: Rules, constructor_checks: bool) -> dict[str, Any]:
    """Kernel constructor (§1.0): read every attribute with the kernel's default, enforce its invariants."""
    a: dict[str, Any] = dict(PAGED_ATTENTION.kernel_defaults())
    for name, value in attrs.items():
        if value is not None:
            a[name] = attr_value(name, value, r)
    nh, kvh = a.get("num_heads"), a.get("kv_num_heads")
    if nh is None or nh <= 0:
        r.fail(
            "ctor.num_heads",
            "num_heads",
            f'info.GetAttr("num_heads", &num_heads).IsOK() && num_heads > 0 was false. Got num_heads={nh}.',
        )
    # the helper divides by kv_num_heads, so positivity is enforced even when emulating the helper alone
    if kvh is None or kvh <= 0 or (constructor_checks and nh % kvh != 0):
        r.fail(
            "ctor.kv_num_heads",
            "kv_num_heads",
            'info.GetAttr("kv_num_heads", &kv_num_heads).IsOK() && kv_num_heads > 0 && '
            f"num_heads % kv_num_heads == 0 was false. Got num_heads={nh}, kv_num_heads={kvh}.",
        )
    eps = a["qk_norm_epsilon"]
    if constructor_checks and not (math.isfinite(eps) and eps > 0.0):
        r.fail(
            "ctor.qk_norm_epsilon", "qk_norm_epsilon", f"qk_norm_epsilon must be a positive finite number (got {eps})."
        )
    for attr in ("k_quant_type", "v_quant_type"):
        s = a[attr]
        if s.upper() not in _QUANT_TYPES:
            r.fail(
                "ctor.quant_type",
                attr,
                f"Invalid KV quantization type: '{s}'. Valid values are: NONE, PER_TENSOR, PER_CHANNEL.",
            )
        a[attr] = s.upper()
    for attr in ("k_cache_dtype", "v_cache_dtype"):
        s = a[attr]
        if s.lower() not in _CACHE_DTYPES:
            r.fail(
                "ctor.cache_dtype",
                attr,
                f"Invalid KV cache data type: '{s}'. Valid values are: '' (use the cache tensor's element type), "
                "float16, bfloat16, int8, float8e4m3fn, int4, float4e2m1. Unsigned types are excluded because "
                "quantization here is symmetric with no zero point.",
            )
        a[attr] = s.lower()
    if a["kv_cache_layout"] not in ("SEPARATE", "LATENT"):
        r.fail(
            "ctor.kv_cache_layout",
            "kv_cache_layout",
            f"'kv_cache_layout' must be 'SEPARATE' or 'LATENT', got '{a['kv_cache_layout']}'",
        )
    if a["v_head_size"] < 0:
        r.fail("ctor.v_head_size", "v_head_size", f"'v_head_size' must be non-negative, got {a['v_head_size']}")
    if a["rotary_offset"] < 0:
        r.fail("ctor.rotary_offset", "rotary_offset", f"'rotary_offset' must be non-negative, got {a['rotary_offset']}")
    return a
