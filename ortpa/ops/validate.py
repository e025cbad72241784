"""ONNX Runtime's PagedAttention input checks, rule by rule, in the kernel's order and with its wording.

:func:`check_inputs` raises :class:`ortpa.errors.InvalidArgument` for the first broken rule, exactly as the
kernel stops at its first failing check, and otherwise returns the derived
:class:`~ortpa.ops.params.PagedAttentionParams`. The order (reference ``paged_attention_facts.md``):

* ``type.*``   type binding at graph resolution (required inputs, attribute names/types, T / T_CACHE / S /
  T_KV_SCALE), in ONNX Runtime's "Type Error: ..." / "Type parameter (T) ... bound to different types" style;
* ``ctor.*``   the kernel constructor (§1.0): head counts, qk_norm_epsilon, quant types, cache dtypes, layout,
  v_head_size, rotary_offset;
* ``1.1.*`` … ``1.8.*``  ``paged_attention_helper::CheckInputs`` (§1.1–§1.8), numbered as the reference
  numbers its steps (``1.2.latent.3`` is step 3 of the LATENT Q/K check; ``a``/``b`` split a step with two
  messages); ``1.9.*`` the packed-INT4 (uint8) deltas of §1.9;
* ``1.10.*``   the ``ComputeInternal`` checks decidable on the host (§1.10.1, §1.10.5, §1.10.9).

:data:`RULES` maps every id to a one-line description; ids are stable. Inputs may be arrays or shape/dtype
stand-ins (:class:`TensorInfo`) whose dimensions are ``None`` or strings when symbolic. A rule that needs an
unknown dimension never raises: it is appended to ``unchecked`` as ``(rule_id, reason)`` and the values it
would have derived stay ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ortpa.errors import InvalidArgument
from ortpa.ops.params import PagedAttentionParams
from ortpa.ops.spec import OP_TYPE, PAGED_ATTENTION

__all__ = [
    "RULES",
    "TensorInfo",
    "check_inputs",
    "check_signature",
    "check_types",
    "dtype_name",
    "validate",
    "validate_model",
]

RULES: dict[str, str] = {
    # graph resolution: types and attributes
    "type.required": "every required input (query, key_cache, sequence tensors, block_table) and output 0 are "
    "present; at most 17 inputs and 1-3 outputs",
    "type.attribute": "attributes are known to the schema, have the schema's type, and the required ones are given",
    "type.T": "T inputs are float16 or bfloat16",
    "type.T.bind": "all T inputs (query, key, value, cos/sin, head_sink, q/k norm weights) share one type",
    "type.T_CACHE": "caches are float16, bfloat16, int8, float8e4m3fn or uint8",
    "type.T_CACHE.bind": "key_cache and value_cache share one type",
    "type.S": "index inputs are int32",
    "type.T_KV_SCALE": "k_scale / v_scale are float32",
    # kernel constructor §1.0
    "ctor.num_heads": "num_heads is given and > 0",
    "ctor.kv_num_heads": "kv_num_heads is given, > 0 and divides num_heads",
    "ctor.qk_norm_epsilon": "qk_norm_epsilon is finite and > 0 (even without norm weights)",
    "ctor.quant_type": "k_quant_type / v_quant_type is NONE, PER_TENSOR or PER_CHANNEL (case-insensitive)",
    "ctor.cache_dtype": "k_cache_dtype / v_cache_dtype is '', float16, bfloat16, int8, float8e4m3fn, int4, float4e2m1",
    "ctor.kv_cache_layout": "kv_cache_layout is 'SEPARATE' or 'LATENT' (case-sensitive)",
    "ctor.v_head_size": "v_head_size >= 0",
    "ctor.rotary_offset": "rotary_offset >= 0",
    # §1.1 head counts
    "1.1.1": "num_heads <= max_threads_per_block (CUDA: 1024)",
    "1.1.2": "num_heads is a multiple of kv_num_heads",
    # §1.2 LATENT Q/K
    "1.2.latent.1": "LATENT: key is present",
    "1.2.latent.2": "LATENT: value is absent",
    "1.2.latent.3": "LATENT: query is 2-D",
    "1.2.latent.4": "LATENT: query hidden size is a multiple of num_heads",
    "1.2.latent.5": "LATENT: head_size is a multiple of 8",
    "1.2.latent.6": "LATENT: key is 2-D",
    "1.2.latent.7": "LATENT: query and key have the same token count",
    "1.2.latent.8": "LATENT: key hidden size is kv_num_heads * head_size",
    # §1.2 SEPARATE with key
    "1.2.separate.1": "SEPARATE: query is 2-D",
    "1.2.separate.2": "SEPARATE: head_size (query hidden // num_heads) is a multiple of 8",
    "1.2.separate.3": "SEPARATE: value is present when key is",
    "1.2.separate.4a": "SEPARATE: key is 2-D",
    "1.2.separate.4b": "SEPARATE: query and key have the same token count",
    "1.2.separate.5a": "SEPARATE: key hidden size is a multiple of kv_num_heads",
    "1.2.separate.5b": "SEPARATE: key hidden size / kv_num_heads equals head_size",
    "1.2.separate.6a": "SEPARATE: value is 2-D",
    "1.2.separate.6b": "SEPARATE: query and value have the same token count",
    "1.2.separate.6c": "SEPARATE: value hidden size equals key hidden size",
    # §1.2 packed QKV
    "1.2.packed.1": "packed QKV: query is 2-D",
    "1.2.packed.2": "packed QKV: head_size (dim 1 // (num_heads + 2 kv_num_heads)) is a multiple of 8",
    "1.2.packed.3": "packed QKV: value is absent when key is",
    # §1.3 v_head_size and scale
    "1.3.1": "v_head_size is 0 or in [1, head_size]",
    "1.3.2": "v_head_size differs from head_size only in LATENT",
    "1.3.3": "an explicit non-zero scale is given when v_head_size differs from head_size",
    # §1.4 layout constraints
    "1.4.latent.1": "LATENT: value_cache is absent",
    "1.4.latent.2": "LATENT: kv_num_heads is 1",
    "1.4.latent.3": "LATENT: head_sink is absent",
    "1.4.latent.4": "LATENT: q_norm_weight / k_norm_weight are absent",
    "1.4.latent.5": "LATENT: v_scale, v_quant_type and v_cache_dtype are unset",
    "1.4.separate.1": "SEPARATE: value_cache is present",
    # §1.5 CheckKVCache
    "1.5.1": "key_cache is 4-D",
    "1.5.2": "block_size is a power of two and at least 16",
    "1.5.3": "key_cache dim 2 equals kv_num_heads",
    "1.5.4": "key_cache dim 3 equals head_size",
    "1.5.6": "value_cache is 4-D",
    "1.5.7a": "value_cache dim 0 equals num_blocks",
    "1.5.7b": "value_cache dim 1 equals block_size",
    "1.5.8": "key_cache and value_cache dim 2 agree",
    "1.5.9": "value_cache dim 2 equals kv_num_heads",
    "1.5.10": "key_cache and value_cache dim 3 agree",
    "1.5.11": "value_cache dim 3 equals head_size",
    # §1.6 sequence tensors, block table, slot mapping
    "1.6.1": "cumulative_sequence_length is 1-D with at least 2 entries",
    "1.6.2": "past_seqlens is 1-D of length batch_size",
    "1.6.3": "block_table is 2-D",
    "1.6.4": "block_table dim 0 equals batch_size",
    "1.6.5": "block_table dim 1 is positive (later helper versions)",
    "1.6.6": "slot_mapping is 1-D",
    "1.6.7": "slot_mapping length equals token_count",
    # §1.7 head_sink, QK norm, rotary, rotary_offset
    "1.7.1": "head_sink is 1-D",
    "1.7.2": "head_sink length equals num_heads",
    "1.7.3": "q_norm_weight and k_norm_weight are given together",
    "1.7.4": "q_norm_weight has shape (head_size)",
    "1.7.5": "k_norm_weight has shape (head_size)",
    "1.7.6": "qk_norm_epsilon > 0 when norm weights are given (helper; unreachable after the constructor)",
    "1.7.7": "head_size is a multiple of 16 when rotary caches are given",
    "1.7.rank": "cos_cache / sin_cache are 2-D (ortpa: ONNX Runtime reads dims 0 and 1 without checking)",
    "1.7.8": "cos_cache dim 1 is <= head_size / 2 and a multiple of 8",
    "1.7.9": "sin_cache dim 1 is <= head_size / 2 and a multiple of 8",
    "1.7.10": "cos_cache and sin_cache dim 1 agree",
    "1.7.11": "cos_cache and sin_cache are both present or both absent",
    "1.7.12": "rotary_offset is non-negative and a multiple of 8",
    "1.7.13": "rotary_offset + rotary_dim <= head_size",
    # §1.8 quantization, cache dtype, metadata
    "1.8.1": "no scale input when the quant type is NONE",
    "1.8.2": "a quantized cache has a quant type other than NONE",
    "1.8.3": "a quant type other than NONE needs a quantized cache",
    "1.8.4": "a quant type other than NONE needs its scale input",
    "1.8.5": "PER_TENSOR scale has exactly one element",
    "1.8.6": "PER_CHANNEL scale has shape (kv_num_heads, 1, head_size)",
    "1.8.7": "a sub-byte cache dtype (int4, float4e2m1) needs a uint8 packed cache",
    "1.8.8": "a named cache dtype agrees with the cache tensor's element type",
    "1.8.9": "attention_metadata has shape (2) or (3)",
    # §1.9 INT4 (uint8) deltas
    "1.9.1": "a uint8 cache names its logical type: k_cache_dtype / v_cache_dtype == 'int4'",
    "1.9.2": "packed int4 key_cache dim 3 is (head_size + 1) // 2",
    "1.9.3": "packed int4 value_cache dim 3 is (head_size + 1) // 2",
    # §1.10 ComputeInternal, host-decidable
    "1.10.1": "do_rotary=1 needs cos_cache and sin_cache",
    "1.10.5": "at least one cache block for non-empty input",
    "1.10.9.1": "attention_metadata entries are non-negative (values known on host)",
    "1.10.9.2": "attention_metadata lower bound <= effective max_kv_len bound (values known on host)",
}

# ------------------------------------------------------------------------------------------ dtypes
_ONNX_ELEM: dict[int, str] = {}
for _name, _num in __import__("onnx").TensorProto.DataType.items():
    _ONNX_ELEM[_num] = {"FLOAT": "float32", "DOUBLE": "float64", "UNDEFINED": ""}.get(_name, _name.lower())
_NP_ALIASES = {
    "float8_e4m3fn": "float8e4m3fn",
    "float8_e5m2": "float8e5m2",
    "float8_e4m3fnuz": "float8e4m3fnuz",
    "float8_e5m2fnuz": "float8e5m2fnuz",
    "float4_e2m1fn": "float4e2m1",
    "float": "float32",
    "double": "float64",
    "half": "float16",
}


def dtype_name(dtype: Any) -> str | None:
    """Normalise a numpy / ml_dtypes dtype, an ONNX ``TensorProto`` elem type or a type string to a name.

    Returns names like ``"float16"``, ``"bfloat16"``, ``"float8e4m3fn"``, ``"int32"``, ``"float32"``; ``None``
    when the type is unknown (not declared); ``"unknown(<repr>)"`` for something that is not a type at all.
    """
    if dtype is None:
        return None
    if isinstance(dtype, (int, np.integer)) and not isinstance(dtype, bool):
        name = _ONNX_ELEM.get(int(dtype))
        return (name or None) if name is not None else f"unknown({int(dtype)})"
    if isinstance(dtype, str):
        s = dtype.strip().lower()
        if s.startswith("tensor(") and s.endswith(")"):
            s = s[7:-1]
        return _NP_ALIASES.get(s, s) if s else None
    try:
        name = np.dtype(dtype).name
    except Exception:  # not a dtype at all: report it, never crash
        return f"unknown({dtype!r})"
    return _NP_ALIASES.get(name, name)


def _ort_type(name: str) -> str:
    """ONNX Runtime's spelling in messages: tensor(float), tensor(float16), ..."""
    return f"tensor({ {'float32': 'float', 'float64': 'double'}.get(name, name) })"


# ------------------------------------------------------------------------------------------ inputs
@dataclass(frozen=True)
class TensorInfo:
    """A shape/dtype stand-in for an input: ``shape`` None means unknown rank; a dim None/str is symbolic."""

    shape: tuple[Any, ...] | None
    dtype: Any = None


def _shape_of(x: Any) -> tuple[int | None, ...] | None:
    shape = getattr(x, "shape", None)
    if shape is None:
        return None
    try:
        dims = tuple(shape)
    except TypeError:
        return None
    # a negative dim is how several shape conventions spell "unknown"; a string is a symbolic name
    return tuple(
        int(d)
        if isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
        else d
        if isinstance(d, str) and d
        else None
        for d in dims
    )


def _fmt_shape(shape: tuple[int | None, ...]) -> str:
    """TensorShape::ToString(): {4,1,16}."""
    return "{" + ",".join("?" if d is None else str(d) for d in shape) + "}"


class _Rules:
    """Raise on a broken rule; record a rule that needs an unknown value as unchecked."""

    def __init__(self, node: str | None, unchecked: list | None) -> None:
        self.node = node
        self.unchecked = unchecked if unchecked is not None else []

    def fail(self, rule: str, name: str, message: str) -> None:
        raise InvalidArgument(rule, name, message, node=self.node)

    def check(self, rule: str, name: str, deps: Mapping[str, Any], broken, message) -> bool:
        """``broken()``/``message()`` are only called when every dep is known. Returns True if decided."""
        unknown = [k for k, v in deps.items() if v is None]
        if unknown:
            self.unchecked.append((rule, f"needs {', '.join(unknown)}, which is not known"))
            return False
        if broken():
            self.fail(rule, name, message())
        return True

    def same(self, rule: str, name: str, x: tuple[str, Any], y: tuple[str, Any], message) -> None:
        """Equality of two dims: concrete ints compare; one symbolic name on both sides is equal."""
        (_, xv), (_, yv) = x, y
        if isinstance(xv, int) and isinstance(yv, int):
            if xv != yv:
                self.fail(rule, name, message())
        elif xv is None or yv is None or xv != yv:
            unknown = [lbl for lbl, v in (x, y) if not isinstance(v, int)]
            self.unchecked.append((rule, f"needs {', '.join(unknown)}, which is not known"))


def _present(inputs: Mapping[str, Any], name: str) -> bool:
    return inputs.get(name) is not None


def _rank(shape: tuple | None) -> int | None:
    return None if shape is None else len(shape)


def _raw(shape: tuple | None, i: int) -> int | str | None:
    """Dim ``i`` as declared: an int, a symbolic name, or None (unknown rank, out of range, unnamed)."""
    if shape is None or not -len(shape) <= i < len(shape):
        return None
    return shape[i]


def _dim(shape: tuple | None, i: int) -> int | None:
    """Dim ``i`` when it is a concrete number, else None."""
    d = _raw(shape, i)
    return d if isinstance(d, int) else None


# ------------------------------------------------------------------------------------------ attributes
_ATTR_SPECS = PAGED_ATTENTION.attribute_map


def _attr_value(name: str, value: Any, r: _Rules) -> Any:
    spec = _ATTR_SPECS.get(name)
    if spec is None:
        r.fail("type.attribute", name, f"Unrecognized attribute: {name} for operator {OP_TYPE}")
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
    if found != spec.type:
        where = r.node or ""
        r.fail(
            "type.attribute",
            name,
            f"Mismatched attribute type in '{where} : {name}'. Expected: '{spec.type}', actual: '{found}'",
        )
    return int(value) if spec.type == "INT" else float(value) if spec.type == "FLOAT" else value


_QUANT_TYPES = ("NONE", "PER_TENSOR", "PER_CHANNEL")
_CACHE_DTYPES = ("", "float16", "bfloat16", "int8", "float8e4m3fn", "int4", "float4e2m1")
_T_TYPES = ("float16", "bfloat16")
_CACHE_TYPES = ("float16", "bfloat16", "int8", "float8e4m3fn", "uint8")
_STORAGE = {"uint8": "int4", "int8": "int8", "float8e4m3fn": "float8e4m3fn", "bfloat16": "bfloat16"}


def check_types(inputs: Mapping[str, Any], *, node: str | None = None, unchecked: list | None = None) -> None:
    """Graph-resolution type binding (``type.required``, ``type.T*``, ``type.S``) for the given inputs."""
    r = _Rules(node, unchecked)
    for f in PAGED_ATTENTION.inputs:
        if not f.optional and not _present(inputs, f.name):
            r.fail("type.required", f.name, f"Required input '{f.name}' (input {f.index}) of {OP_TYPE} is missing.")
    where = node or ""
    bound: dict[str, tuple[str, str]] = {}
    for f in PAGED_ATTENTION.inputs:
        if not _present(inputs, f.name):
            continue
        name = dtype_name(getattr(inputs[f.name], "dtype", None))
        rule = f"type.{f.type_param}"
        if name is None:
            r.unchecked.append((rule, f"the element type of '{f.name}' is not known"))
            continue
        allowed = {"T": _T_TYPES, "T_CACHE": _CACHE_TYPES, "S": ("int32",), "T_KV_SCALE": ("float32",)}
        if name not in allowed[f.type_param]:
            r.fail(
                rule,
                f.name,
                f"Type Error: Type '{_ort_type(name)}' of input parameter ({f.name}) of operator "
                f"({OP_TYPE}) in node ({where}) is invalid.",
            )
        first = bound.setdefault(f.type_param, (name, f.name))
        if first[0] != name:
            r.fail(
                f"{rule}.bind",
                f.name,
                f"Type Error: Type parameter ({f.type_param}) of Optype ({OP_TYPE}) bound to different types "
                f"({_ort_type(first[0])} and {_ort_type(name)} in node ({where}).",
            )


def check_signature(
    inputs: Sequence[str], outputs: Sequence[str], attribute_types: Mapping[str, str], *, node: str | None = None
) -> None:
    """Graph resolution's node checks (ONNX ``OpSchema::Verify``) on an ONNX node, with ONNX Runtime's wording.

    ``inputs`` / ``outputs`` are the node's input and output names ("" = an absent optional slot) and
    ``attribute_types`` maps each attribute to its ``AttributeProto`` type name ("INT", "FLOAT", "INTS", ...).
    In ONNX Runtime's order: input and output counts, required inputs and output 0 present, each attribute
    known and of the schema's type, required attributes present. A Python attribute dict cannot express the
    types (an int is accepted for a FLOAT attribute there), so :func:`ortpa.ops.node_check.validate_model`
    calls this on the node before :func:`check_types`.
    """
    r = _Rules(node, None)
    where = node or ""
    schema = f"schema({PAGED_ATTENTION.domain}::{OP_TYPE}:{PAGED_ATTENTION.since_version})"
    min_in = 1 + max(f.index for f in PAGED_ATTENTION.inputs if not f.optional)
    for what, names, lo, hi in (
        ("input", inputs, min_in, len(PAGED_ATTENTION.inputs)),
        ("output", outputs, 1, len(PAGED_ATTENTION.outputs)),
    ):
        if not lo <= len(names) <= hi:
            r.fail(
                "type.required",
                f"{what}s",
                f"Node({where}) with {schema} has {what} size {len(names)} not in range [min={lo}, max={hi}].",
            )
    for what, formals, names in (
        ("input", PAGED_ATTENTION.inputs, inputs),
        ("output", PAGED_ATTENTION.outputs, outputs),
    ):
        for f in formals:
            if not f.optional and not names[f.index]:
                r.fail(
                    "type.required",
                    f.name,
                    f"Node ({where})'s {what} {f.index} is marked single but has an empty string in the graph",
                )
    for name, found in attribute_types.items():
        spec = _ATTR_SPECS.get(name)
        if spec is None:
            r.fail("type.attribute", name, f"Unrecognized attribute: {name} for operator {OP_TYPE}")
        if found != spec.type:
            r.fail(
                "type.attribute",
                name,
                f"Mismatched attribute type in '{where} : {name}'. Expected: '{spec.type}', actual: '{found}'",
            )
    for spec in PAGED_ATTENTION.attributes:
        if spec.required and spec.name not in attribute_types:
            r.fail("type.attribute", spec.name, f"Required attribute '{spec.name}' is missing.")


def _ctor(attrs: Mapping[str, Any], r: _Rules, constructor_checks: bool) -> dict[str, Any]:
    """Kernel constructor (§1.0): read every attribute with the kernel's default, enforce its invariants."""
    a: dict[str, Any] = dict(PAGED_ATTENTION.kernel_defaults())
    for name, value in attrs.items():
        if value is not None:
            a[name] = _attr_value(name, value, r)
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


def check_inputs(
    inputs: Mapping[str, Any],
    attrs: Mapping[str, Any],
    *,
    node: str | None = None,
    max_threads_per_block: int = 1024,
    unchecked: list | None = None,
    constructor_checks: bool = True,
) -> PagedAttentionParams:
    """Apply ONNX Runtime's PagedAttention input rules in order; return the derived parameters.

    ``inputs`` maps schema input names to arrays or ``.shape``/``.dtype`` stand-ins (absent or None = not
    given); ``attrs`` maps attribute names to values (absent = kernel default). ``max_threads_per_block`` is
    1024 for CUDA, 0 to skip rule 1.1.1 (WebGPU). ``constructor_checks=False`` emulates the shared helper
    alone (WebGPU's constructor does not enforce the CUDA constructor's invariants), which makes the
    helper's own duplicates (1.1.2, 1.7.6) reachable. Raises :class:`InvalidArgument` on the first broken
    rule; appends ``(rule, reason)`` to ``unchecked`` for each rule an unknown dimension left undecided.
    """
    r = _Rules(node, unchecked)
    check_types(inputs, node=node, unchecked=r.unchecked)
    a = _ctor(attrs, r, constructor_checks)
    nh: int = a["num_heads"]
    kvh: int = a["kv_num_heads"]
    latent = a["kv_cache_layout"] == "LATENT"
    has = {f.name: _present(inputs, f.name) for f in PAGED_ATTENTION.inputs}
    shp = {n: _shape_of(inputs[n]) if has[n] else None for n in has}
    kc_type = dtype_name(getattr(inputs["key_cache"], "dtype", None))
    storage = None if kc_type is None else _STORAGE.get(kc_type, "float16")
    quantized = None if storage is None else storage in ("int8", "float8e4m3fn", "int4", "float4e2m1")

    # §1.1 head counts
    if max_threads_per_block > 0 and nh > max_threads_per_block:
        r.fail("1.1.1", "num_heads", f"num_heads should be no larger than {max_threads_per_block}")
    if nh % kvh != 0:
        r.fail(
            "1.1.2",
            "num_heads",
            f"num_heads must be a multiple of kv_num_heads. Got num_heads % kv_num_heads == {nh % kvh}",
        )

    # §1.2 Q/K/V mode: the layout is inspected before the presence of key
    q = shp["query"]
    q_rank, tok, q_hidden = _rank(q), _raw(q, 0), _dim(q, 1)
    token_count = tok if isinstance(tok, int) else None
    head_size = kv_hidden = None
    packed = not latent and not has["key"]
    if latent:
        if not has["key"]:
            r.fail("1.2.latent.1", "key", "Input 'key' is required when 'kv_cache_layout' is 'LATENT'.")
        if has["value"]:
            r.fail(
                "1.2.latent.2",
                "value",
                "Input 'value' must be absent when 'kv_cache_layout' is 'LATENT': the value of every head is "
                "the leading 'v_head_size' channels of the latent key.",
            )
        r.check(
            "1.2.latent.3",
            "query",
            {"rank of query": q_rank},
            lambda: q_rank != 2,
            lambda: f"Input 'query' is expected to have 2 dimensions, got {q_rank}",
        )
        if r.check(
            "1.2.latent.4",
            "query",
            {"query dim 1": q_hidden},
            lambda: q_hidden % nh != 0,
            lambda: (
                f"Input 'query' hidden size must be a multiple of num_heads. Got {q_hidden} % {nh} == {q_hidden % nh}"
            ),
        ):
            head_size = q_hidden // nh
        r.check(
            "1.2.latent.5",
            "query",
            {"head_size": head_size},
            lambda: head_size % 8 != 0,
            lambda: f"head_size must be a multiple of 8. Got head_size % 8 == {head_size % 8}",
        )
        k = shp["key"]
        k_rank = _rank(k)
        r.check(
            "1.2.latent.6",
            "key",
            {"rank of key": k_rank},
            lambda: k_rank != 2,
            lambda: f"Input 'key' is expected to have 2 dimensions, got {k_rank}",
        )
        r.same(
            "1.2.latent.7",
            "key",
            ("query dim 0", tok),
            ("key dim 0", _raw(k, 0)),
            lambda: "Input 'query' and 'key' shall have same dim 0 (token count)",
        )
        kv_hidden = _dim(k, 1)
        r.check(
            "1.2.latent.8",
            "key",
            {"head_size": head_size, "key dim 1": kv_hidden},
            lambda: kv_hidden != kvh * head_size,
            lambda: (
                "Input 'key' is expected to have hidden size kv_num_heads * head_size = "
                f"{kvh * head_size} in 'LATENT' mode, got {kv_hidden}"
            ),
        )
    elif not packed:
        r.check(
            "1.2.separate.1",
            "query",
            {"rank of query": q_rank},
            lambda: q_rank != 2,
            lambda: f"Input 'query' is expected to have 2 dimensions, got {q_rank}",
        )
        head_size = None if q_hidden is None else q_hidden // nh  # divisibility is not checked (ORT quirk)
        r.check(
            "1.2.separate.2",
            "query",
            {"head_size": head_size},
            lambda: head_size % 8 != 0,
            lambda: f"head_size must be a multiple of 8. Got head_size % 8 == {head_size % 8}",
        )
        if not has["value"]:
            r.fail(
                "1.2.separate.3",
                "value",
                "Input 'key' and 'value' shall be both present, or both absent in the case of packed qkv.",
            )
        k = shp["key"]
        k_rank = _rank(k)
        r.check(
            "1.2.separate.4a",
            "key",
            {"rank of key": k_rank},
            lambda: k_rank != 2,
            lambda: f"Input 'key' is expected to have 2 dimensions, got {k_rank}",
        )
        r.same(
            "1.2.separate.4b",
            "key",
            ("query dim 0", tok),
            ("key dim 0", _raw(k, 0)),
            lambda: "Input 'query' and 'key' shall have same dim 0 (token count)",
        )
        kv_hidden = _dim(k, 1)
        r.check(
            "1.2.separate.5a",
            "key",
            {"key dim 1": kv_hidden},
            lambda: kv_hidden % kvh != 0,
            lambda: (
                "kv_hidden_size must be a multiple of kv_num_heads. Got kv_hidden_size % kv_num_heads"
                f" == {kv_hidden % kvh}"
            ),
        )
        r.check(
            "1.2.separate.5b",
            "key",
            {"key dim 1": kv_hidden, "head_size": head_size},
            lambda: kv_hidden // kvh != head_size,
            lambda: (
                "kv_hidden_size / kv_num_heads must be equal to head_size. Got kv_hidden_size / "
                f"kv_num_heads == {kv_hidden // kvh}"
            ),
        )
        v = shp["value"]
        v_rank = _rank(v)
        r.check(
            "1.2.separate.6a",
            "value",
            {"rank of value": v_rank},
            lambda: v_rank != 2,
            lambda: f"Input 'value' is expected to have 2 dimensions, got {v_rank}",
        )
        r.same(
            "1.2.separate.6b",
            "value",
            ("query dim 0", tok),
            ("value dim 0", _raw(v, 0)),
            lambda: "Input 'query' and 'value' shall have same dim 0 (token count)",
        )
        r.same(
            "1.2.separate.6c",
            "value",
            ("key dim 1", _raw(k, 1)),
            ("value dim 1", _raw(v, 1)),
            lambda: "Input 'value' is expected to have same hidden size as key.",
        )
    else:
        r.check(
            "1.2.packed.1",
            "query",
            {"rank of query": q_rank},
            lambda: q_rank != 2,
            lambda: f"Input 'query' is expected to have 2 dimensions, got {q_rank}",
        )
        head_size = None if q_hidden is None else q_hidden // (nh + 2 * kvh)  # remainder unchecked (ORT)
        r.check(
            "1.2.packed.2",
            "query",
            {"head_size": head_size},
            lambda: head_size % 8 != 0,
            lambda: f"head_size must be a multiple of 8. Got head_size % 8 == {head_size % 8}",
        )
        if has["value"]:
            r.fail(
                "1.2.packed.3",
                "value",
                "Input 'key' and 'value' shall be both present, or both absent in the case of packed qkv.",
            )
        if head_size is not None:
            q_hidden, kv_hidden = head_size * nh, head_size * kvh

    # §1.3 v_head_size and scale
    v_attr, scale_attr = a["v_head_size"], a["scale"]
    explicit_scale = scale_attr != 0.0  # an explicit 0.0 counts as unset (CUDA)
    v_head_size = head_size
    if v_attr != 0:
        r.check(
            "1.3.1",
            "v_head_size",
            {"head_size": head_size},
            lambda: v_attr < 1 or v_attr > head_size,
            lambda: (
                f"'v_head_size' must be 0 (meaning head_size) or in [1, head_size] = [1, {head_size}], got {v_attr}"
            ),
        )
        r.check(
            "1.3.2",
            "v_head_size",
            {"head_size": head_size},
            lambda: v_attr != head_size and not latent,
            lambda: (
                f"'v_head_size' ({v_attr}) may only differ from head_size ({head_size}) when "
                "'kv_cache_layout' is 'LATENT'."
            ),
        )
        v_head_size = v_attr
    r.check(
        "1.3.3",
        "scale",
        {"head_size": head_size, "v_head_size": v_head_size},
        lambda: v_head_size != head_size and not explicit_scale,
        lambda: (
            f"An explicit 'scale' attribute is required when 'v_head_size' ({v_head_size}) differs from "
            f"head_size ({head_size}): the default 1/sqrt(head_size) is not the intended scale for absorbed MLA."
        ),
    )

    # §1.4 layout constraints
    if latent:
        if has["value_cache"]:
            r.fail(
                "1.4.latent.1",
                "value_cache",
                "Input 'value_cache' must be absent when 'kv_cache_layout' is 'LATENT': the value cache is the "
                "leading 'v_head_size' channels of 'key_cache'.",
            )
        if kvh != 1:
            r.fail(
                "1.4.latent.2",
                "kv_num_heads",
                f"'kv_num_heads' must be 1 when 'kv_cache_layout' is 'LATENT', got {kvh}",
            )
        if has["head_sink"]:
            r.fail(
                "1.4.latent.3", "head_sink", "Input 'head_sink' is not supported when 'kv_cache_layout' is 'LATENT'."
            )
        if has["q_norm_weight"] or has["k_norm_weight"]:
            r.fail(
                "1.4.latent.4",
                "q_norm_weight" if has["q_norm_weight"] else "k_norm_weight",
                "Inputs 'q_norm_weight' / 'k_norm_weight' are not supported when 'kv_cache_layout' is 'LATENT': "
                "DeepSeek normalizes the latent projections in the graph, before absorption.",
            )
        if has["v_scale"] or a["v_quant_type"] != "NONE" or a["v_cache_dtype"] != "":
            r.fail(
                "1.4.latent.5",
                "v_scale" if has["v_scale"] else "v_quant_type" if a["v_quant_type"] != "NONE" else "v_cache_dtype",
                "Input 'v_scale' and attributes 'v_quant_type' / 'v_cache_dtype' must be unset when "
                "'kv_cache_layout' is 'LATENT': the value elements are the key elements, so 'k_scale' and "
                "'k_cache_dtype' describe both.",
            )
    elif not has["value_cache"]:
        r.fail("1.4.separate.1", "value_cache", "Input 'value_cache' is required unless 'kv_cache_layout' is 'LATENT'.")

    # §1.5 CheckKVCache (§1.9: a packed int4 cache stores (head_size + 1) // 2 bytes per row)
    num_blocks, block_size = _check_kv_cache(shp, has["value_cache"], kvh, head_size, storage, r)

    # §1.6 sequence tensors, block table, slot mapping
    cum, past, bt = shp["cumulative_sequence_length"], shp["past_seqlens"], shp["block_table"]
    batch_size = None
    if cum is None or (len(cum) == 1 and not isinstance(cum[0], int)):
        r.unchecked.append(("1.6.1", "needs the shape of cumulative_sequence_length, which is not known"))
    elif len(cum) != 1 or cum[0] < 2:
        r.fail("1.6.1", "cumulative_sequence_length", "cumulative_sequence_length must be shape (batch_size + 1).")
    else:
        batch_size = cum[0] - 1
    if past is not None and len(past) != 1:
        r.fail("1.6.2", "past_seqlens", "seqlens must be shape (batch_size).")
    r.check(
        "1.6.2",
        "past_seqlens",
        {"batch_size": batch_size, "past_seqlens dim 0": _dim(past, 0)},
        lambda: past[0] != batch_size,
        lambda: "seqlens must be shape (batch_size).",
    )
    bt_rank = _rank(bt)
    max_blocks = None
    r.check(
        "1.6.3",
        "block_table",
        {"rank of block_table": bt_rank},
        lambda: bt_rank != 2,
        lambda: "block_table must be 2D.",
    )
    r.check(
        "1.6.4",
        "block_table",
        {"batch_size": batch_size, "block_table dim 0": _dim(bt, 0)},
        lambda: bt[0] != batch_size,
        lambda: f"block_table dimension 0 should be batch_size, got {bt[0]}",
    )
    max_blocks = _dim(bt, 1)
    r.check(
        "1.6.5",
        "block_table",
        {"block_table dim 1": max_blocks},
        lambda: max_blocks == 0,
        lambda: "block_table dimension 1 must be positive, got 0",
    )
    if has["slot_mapping"]:
        sm = shp["slot_mapping"]
        r.check(
            "1.6.6",
            "slot_mapping",
            {"rank of slot_mapping": _rank(sm)},
            lambda: len(sm) != 1,
            lambda: f"Input 'slot_mapping' is expected to have 1 dimension, got {len(sm)}",
        )
        r.same(
            "1.6.7",
            "slot_mapping",
            ("token_count", tok),
            ("slot_mapping dim 0", _raw(sm, 0)),
            lambda: f"Input 'slot_mapping' dimension 0 should be token_count ({tok}), got {sm[0]}",
        )

    # §1.7 head_sink, QK norm, rotary, rotary_offset
    rotary_dim = _check_1_7(has, shp, a, nh, head_size, r)

    # §1.8 quantization, cache dtype, metadata (§1.9 for uint8 caches)
    _check_quant("k", has, shp, a, quantized, kvh, head_size, r)
    if not latent:
        _check_quant("v", has, shp, a, quantized, kvh, v_head_size, r)
    for attr in ("k_cache_dtype",) if latent else ("k_cache_dtype", "v_cache_dtype"):
        _check_cache_dtype(attr, a[attr], storage, r)
    if has["attention_metadata"]:
        md = shp["attention_metadata"]
        r.check(
            "1.8.9",
            "attention_metadata",
            {"shape of attention_metadata": md and _dim(md, 0)},
            lambda: len(md) != 1 or md[0] not in (2, 3),
            lambda: f"Input 'attention_metadata' must have shape (2) or (3), got {_fmt_shape(md)}",
        )

    # §1.10 ComputeInternal, the parts decidable on the host
    do_rotary = a["do_rotary"] == 1
    if do_rotary and not (has["cos_cache"] and has["sin_cache"]):
        r.fail("1.10.1", "cos_cache", "cos_cache and sin_cache must be passed to PagedAttention when do_rotary = 1")
    if token_count != 0:
        r.check(
            "1.10.5",
            "key_cache",
            {"token_count": token_count, "num_blocks": num_blocks},
            lambda: num_blocks <= 0,
            lambda: "PagedAttention requires at least one physical cache block for non-empty input.",
        )
        _check_metadata_values(inputs.get("attention_metadata"), token_count, max_blocks, block_size, r)

    k_dtype = a["k_cache_dtype"] or storage
    return PagedAttentionParams(
        batch_size=batch_size,
        token_count=token_count,
        num_heads=nh,
        kv_num_heads=kvh,
        head_size=head_size,
        v_head_size=v_head_size,
        hidden_size=q_hidden,
        kv_hidden_size=kv_hidden,
        num_blocks=num_blocks,
        block_size=block_size,
        max_blocks_per_seq=max_blocks,
        rotary_dim=rotary_dim,
        layout=a["kv_cache_layout"],
        is_packed_qkv=packed,
        is_causal=a["is_causal"] == 1,
        do_rotary=do_rotary,
        rotary_interleaved=a["rotary_interleaved"] == 1,
        rotary_offset=a["rotary_offset"],
        scale=scale_attr if explicit_scale else (1.0 / math.sqrt(head_size) if head_size else 0.0),
        has_explicit_scale=explicit_scale,
        softcap=a["softcap"],
        local_window_size=a["local_window_size"],
        qk_norm_epsilon=a["qk_norm_epsilon"],
        use_qk_norm=has["q_norm_weight"],
        has_head_sink=has["head_sink"],
        has_slot_mapping=has["slot_mapping"],
        has_attention_metadata=has["attention_metadata"],
        cache_storage_dtype=storage,
        k_quant_type=a["k_quant_type"],
        v_quant_type=a["v_quant_type"],
        k_cache_dtype=k_dtype,
        activation_dtype=dtype_name(getattr(inputs["query"], "dtype", None)),
        v_cache_dtype=k_dtype if latent else (a["v_cache_dtype"] or storage),
    )


def _check_kv_cache(shp: dict, has_value_cache: bool, kvh: int, head_size: int | None, storage: str | None, r: _Rules):
    """§1.5 CheckKVCache; the expected last dim is (head_size + 1) // 2 for a packed int4 cache (§1.9)."""
    kc = shp["key_cache"]
    r.check(
        "1.5.1",
        "key_cache",
        {"rank of key_cache": _rank(kc)},
        lambda: len(kc) != 4,
        lambda: f"Input 'key_cache' is expected to have 4 dimensions, got {len(kc)}",
    )
    nb, bs, k_heads = _dim(kc, 0), _dim(kc, 1), _dim(kc, 2)
    r.check(
        "1.5.2",
        "key_cache",
        {"block_size (key_cache dim 1)": bs},
        lambda: bs < 16 or (bs & (bs - 1)) != 0,
        lambda: f"block_size must be a power of two and at least 16. Got block_size == {bs}",
    )
    r.check(
        "1.5.3",
        "key_cache",
        {"key_cache dim 2": k_heads},
        lambda: k_heads != kvh,
        lambda: f"Input 'key_cache' shall have kv_num_heads, got {k_heads}",
    )
    int4 = storage == "int4"
    expected = None if head_size is None else (head_size + 1) // 2 if int4 else head_size

    def last_dim_rule(which: str, got: int | None) -> None:
        deps = {"head_size": head_size, "key_cache element type": storage, f"{which} dim 3": got}
        if int4:
            rule = "1.9.2" if which == "key_cache" else "1.9.3"
            text = f"Input '{which}' dimension 3 should be (head_size + 1) / 2 = {expected} for a packed int4 cache"
        else:
            rule = "1.5.4" if which == "key_cache" else "1.5.11"
            text = f"Input '{which}' dimension 3 should be same as head_size"
        r.check(rule, which, deps, lambda: got != expected, lambda: f"{text}, got {got}")

    last_dim_rule("key_cache", _dim(kc, 3))
    if not has_value_cache:
        return nb, bs  # LATENT: the single cache
    vc = shp["value_cache"]
    r.check(
        "1.5.6",
        "value_cache",
        {"rank of value_cache": _rank(vc)},
        lambda: len(vc) != 4,
        lambda: f"Input 'value_cache' is expected to have 4 dimensions, got {len(vc)}",
    )
    for rule, i, what in (("1.5.7a", 0, "num_blocks"), ("1.5.7b", 1, "block_size")):
        r.same(
            rule,
            "value_cache",
            (f"key_cache dim {i} ({what})", _raw(kc, i)),
            (f"value_cache dim {i}", _raw(vc, i)),
            lambda i=i, what=what: f"Input 'value_cache' dimension {i} should be {what}, got {vc[i]}",
        )
    r.same(
        "1.5.8",
        "value_cache",
        ("key_cache dim 2", _raw(kc, 2)),
        ("value_cache dim 2", _raw(vc, 2)),
        lambda: (
            "Input 'key_cache' and 'value_cache' dimension 2 (kv num heads) should be the same, "
            f"got {kc[2]} and {vc[2]}"
        ),
    )
    r.check(
        "1.5.9",
        "value_cache",
        {"value_cache dim 2": _dim(vc, 2)},
        lambda: vc[2] != kvh,
        lambda: f"Input 'value_cache' shall have kv_num_heads, got {vc[2]}",
    )
    r.same(
        "1.5.10",
        "value_cache",
        ("key_cache dim 3", _raw(kc, 3)),
        ("value_cache dim 3", _raw(vc, 3)),
        lambda: (
            f"Input 'key_cache' and 'value_cache' dimension 3 (head size) should be the same, got {kc[3]} and {vc[3]}"
        ),
    )
    last_dim_rule("value_cache", _dim(vc, 3))
    return nb, bs


def _check_1_7(has: dict, shp: dict, a: dict, nh: int, head_size: int | None, r: _Rules) -> int | None:
    """§1.7 head_sink, QK-norm weights, rotary caches and rotary_offset; returns rotary_dim."""
    if has["head_sink"]:
        hs = shp["head_sink"]
        r.check(
            "1.7.1",
            "head_sink",
            {"rank of head_sink": _rank(hs)},
            lambda: len(hs) != 1,
            lambda: "head_sink must be a 1D tensor",
        )
        r.check(
            "1.7.2",
            "head_sink",
            {"head_sink dim 0": _dim(hs, 0)},
            lambda: hs[0] != nh,
            lambda: f"head_sink dimension 0 must be equal to the num heads, got {hs[0]}",
        )
    if has["q_norm_weight"] != has["k_norm_weight"]:
        r.fail(
            "1.7.3",
            "k_norm_weight" if has["q_norm_weight"] else "q_norm_weight",
            "Input 'q_norm_weight' and 'k_norm_weight' must be provided together.",
        )
    if has["q_norm_weight"]:
        for rule, name in (("1.7.4", "q_norm_weight"), ("1.7.5", "k_norm_weight")):
            w = shp[name]
            message = f"Input '{name}' must be a 1D tensor of shape (head_size) = ({head_size})."
            if w is not None and len(w) != 1:
                r.fail(rule, name, message)
            r.check(
                rule,
                name,
                {"head_size": head_size, f"{name} dim 0": _dim(w, 0)},
                lambda w=w: w[0] != head_size,
                lambda message=message: message,
            )
        eps = a["qk_norm_epsilon"]
        if not eps > 0.0:
            r.fail("1.7.6", "qk_norm_epsilon", f"qk_norm_epsilon must be positive, got {eps:g}")
    rotary_dim: int | None = 0
    if has["cos_cache"] and has["sin_cache"]:
        r.check(
            "1.7.7",
            "cos_cache",
            {"head_size": head_size},
            lambda: head_size % 16 != 0,
            lambda: f"head_size shall be a multiple of 16. Got head_size % 16 == {head_size % 16}",
        )
        dims = {}
        for name in ("cos_cache", "sin_cache"):
            c = shp[name]
            r.check(
                "1.7.rank",
                name,
                {f"rank of {name}": _rank(c)},
                lambda c=c: len(c) != 2,
                lambda c=c, name=name: (
                    f"Input '{name}' is expected to have 2 dimensions, got {len(c)} "
                    "(ONNX Runtime does not check this and reads dims 0 and 1 regardless)"
                ),
            )
            dims[name] = _dim(c, 1)
        for rule, name in (("1.7.8", "cos_cache"), ("1.7.9", "sin_cache")):
            d = dims[name]
            r.check(
                rule,
                name,
                {"head_size": head_size, f"{name} dim 1": d},
                lambda d=d: d > (head_size // 16) * 8 or d % 8 != 0,
                lambda name=name: f"{name} dimension 1 must be <= head_size / 2 and a multiple of 8.",
            )
        cos1, sin1 = dims["cos_cache"], dims["sin_cache"]
        r.check(
            "1.7.10",
            "sin_cache",
            {"cos_cache dim 1": cos1, "sin_cache dim 1": sin1},
            lambda: cos1 != sin1,
            lambda: "cos_cache and sin_cache dimension 1 must be the same.",
        )
        rotary_dim = None if cos1 is None else 2 * cos1
    elif has["cos_cache"] or has["sin_cache"]:
        r.fail(
            "1.7.11",
            "sin_cache" if has["cos_cache"] else "cos_cache",
            "Input 'cos_cache' and 'sin_cache' shall be both present or both absent.",
        )
    ro = a["rotary_offset"]
    if ro < 0 or ro % 8 != 0:
        r.fail("1.7.12", "rotary_offset", f"'rotary_offset' must be non-negative and a multiple of 8, got {ro}")
    r.check(
        "1.7.13",
        "rotary_offset",
        {"rotary_dim": rotary_dim, "head_size": head_size},
        lambda: ro + rotary_dim > head_size,
        lambda: f"'rotary_offset' + rotary_dim must not exceed head_size. Got {ro} + {rotary_dim} > {head_size}",
    )
    return rotary_dim


def _check_quant(
    kind: str, has: dict, shp: dict, a: dict, quantized: bool | None, kvh: int, head_size: int | None, r: _Rules
) -> None:
    """§1.8 CheckKVCacheQuantization for the key (``kind="k"``) or value cache."""
    qt_name, scale_name = f"{kind}_quant_type", f"{kind}_scale"
    qt = a[qt_name]
    if qt == "NONE":
        if has[scale_name]:
            r.fail("1.8.1", scale_name, f"Input '{scale_name}' must not be provided when '{qt_name}' is 'NONE'.")
        r.check(
            "1.8.2",
            qt_name,
            {"key_cache element type": quantized},
            lambda: quantized,
            lambda: f"The KV cache has a quantized element type, so '{qt_name}' must be 'PER_TENSOR' or 'PER_CHANNEL'.",
        )
        return
    r.check(
        "1.8.3",
        qt_name,
        {"key_cache element type": quantized},
        lambda: not quantized,
        lambda: (
            f"'{qt_name}' is set, but the KV cache element type is not quantized. Use an int8 or "
            f"float8e4m3fn cache, or set '{qt_name}' to 'NONE'."
        ),
    )
    if not has[scale_name]:
        r.fail("1.8.4", scale_name, f"Input '{scale_name}' is required when '{qt_name}' is not 'NONE'.")
    s = shp[scale_name]
    count = None if s is None or not all(isinstance(d, int) for d in s) else math.prod(s)
    if qt == "PER_TENSOR":
        r.check(
            "1.8.5",
            scale_name,
            {f"shape of {scale_name}": count},
            lambda: count != 1,
            lambda: f"Input '{scale_name}' must have exactly 1 element for PER_TENSOR quantization, got {count}",
        )
    else:
        r.check(
            "1.8.6",
            scale_name,
            {f"shape of {scale_name}": count, "head_size": head_size},
            lambda: count != kvh * head_size or len(s) == 0 or s[-1] != head_size,
            lambda: (
                f"Input '{scale_name}' must have shape (kv_num_heads, 1, head_size) = ({kvh}, 1, "
                f"{head_size}) for PER_CHANNEL quantization, got {_fmt_shape(s)}"
            ),
        )


def _check_cache_dtype(attr: str, value: str, storage: str | None, r: _Rules) -> None:
    """§1.8 CheckKVCacheDataType with the §1.9 rule that a uint8 cache must name 'int4'."""
    if storage is None:
        if value:
            r.unchecked.append(("1.8.8", f"'{attr}' cannot be compared with an unknown cache element type"))
        return
    if storage == "int4" and value == "":
        r.fail(
            "1.9.1",
            attr,
            f"'{attr}' must be 'int4' for a uint8 (packed) cache, got ''. Packed uint8 caches require an "
            "explicit int4 logical type.",
        )
    if value in ("", storage):
        return
    if value in ("int4", "float4e2m1"):
        r.fail(
            "1.8.7", attr, f"'{attr}' == '{value}' requires a uint8 packed cache, which is not enabled in this build."
        )
    r.fail(
        "1.8.8",
        attr,
        f"'{attr}' is '{value}', but the cache tensor's element type is '{storage}'. Leave the attribute at '' "
        "to use the tensor's element type.",
    )


def _check_metadata_values(
    md: Any, token_count: int | None, max_blocks: int | None, block_size: int | None, r: _Rules
) -> None:
    """§1.10.9: attention_metadata lives in CPU memory, so its values are checked on the host when known."""
    if not isinstance(md, np.ndarray) or md.ndim != 1 or md.shape[0] not in (2, 3):
        return  # a stand-in without values, or a shape 1.8.9 has already judged
    if md.dtype.kind not in "iu":
        return  # type.S has already judged the element type
    vals = [int(x) for x in md]
    q, kv, lo = vals[0], vals[1], vals[2] if len(vals) == 3 else 0
    if min(q, kv, lo) < 0:
        r.fail(
            "1.10.9.1",
            "attention_metadata",
            f"PagedAttention: 'attention_metadata' entries must be non-negative, got [{q}, {kv}, {lo}]. "
            "Use 0 for 'unknown'.",
        )
    cap = None if max_blocks is None or block_size is None else max_blocks * block_size
    bound = None if cap is None else kv if 0 < kv < cap else cap
    r.check(
        "1.10.9.2",
        "attention_metadata",
        {"block table capacity": bound},
        lambda: lo > bound,
        lambda: (
            f"PagedAttention: attention_metadata max_kv_len_lower_bound ({lo}) must not exceed "
            f"max_kv_len_bound ({bound})."
        ),
    )


def validate_model(model: Any, backend: str | None = None):
    """Validate every PagedAttention node of ``model``; see :func:`ortpa.ops.node_check.validate_model`."""
    from ortpa.ops.node_check import validate_model as _validate_model  # node_check imports this module

    return _validate_model(model, backend=backend)


validate = validate_model
