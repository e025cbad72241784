"""Graph resolution: the node's signature (ONNX ``OpSchema::Verify``) and type binding (``type.*``).

:func:`check_signature` checks an ONNX node's input/output slots and attribute types; :func:`check_types`
binds the element types of the given inputs to T / T_CACHE / S / T_KV_SCALE. Both speak ONNX Runtime's
"Type Error: ..." / "Node (...) ..." wording, and both run before any kernel rule.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ortpa.ops.spec import OP_TYPE, PAGED_ATTENTION
from ortpa.ops.validate.attrs import attr_spec, check_attr_type
from ortpa.ops.validate.checks import Rules, present
from ortpa.ops.validate.dtypes import dtype_name, ort_type

__all__ = ["check_signature", "check_types"]

_ALLOWED = {
    "T": ("float16", "bfloat16"),
    "T_CACHE": ("float16", "bfloat16", "int8", "float8e4m3fn", "uint8"),
    "S": ("int32",),
    "T_KV_SCALE": ("float32",),
}


def check_types(inputs: Mapping[str, Any], *, node: str | None = None, unchecked: list | None = None) -> None:
    """Graph-resolution type binding (``type.required``, ``type.T*``, ``type.S``) for the given inputs."""
    r = Rules(node, unchecked)
    for f in PAGED_ATTENTION.inputs:
        if not f.optional and not present(inputs, f.name):
            r.fail("type.required", f.name, f"Required input '{f.name}' (input {f.index}) of {OP_TYPE} is missing.")
    where = node or ""
    bound: dict[str, tuple[str, str]] = {}
    for f in PAGED_ATTENTION.inputs:
        if not present(inputs, f.name):
            continue
        name = dtype_name(getattr(inputs[f.name], "dtype", None))
        rule = f"type.{f.type_param}"
        if name is None:
            r.unchecked.append((rule, f"the element type of '{f.name}' is not known"))
            continue
        if name not in _ALLOWED[f.type_param]:
            r.fail(
                rule,
                f.name,
                f"Type Error: Type '{ort_type(name)}' of input parameter ({f.name}) of operator "
                f"({OP_TYPE}) in node ({where}) is invalid.",
            )
        first = bound.setdefault(f.type_param, (name, f.name))
        if first[0] != name:
            r.fail(
                f"{rule}.bind",
                f.name,
                f"Type Error: Type parameter ({f.type_param}) of Optype ({OP_TYPE}) bound to different types "
                f"({ort_type(first[0])} and {ort_type(name)} in node ({where}).",
            )


def check_signature(
    inputs: Sequence[str], outputs: Sequence[str], attribute_types: Mapping[str, str], *, node: str | None = None
) -> None:
    """Graph resolution's node checks (ONNX ``OpSchema::Verify``) on an ONNX node, with ONNX Runtime's wording.

    ``inputs`` / ``outputs`` are the node's input and output names ("" = an absent optional slot) and
    ``attribute_types`` maps each attribute to its ``AttributeProto`` type name ("INT", "FLOAT", "INTS", ...).
    In ONNX Runtime's order: input and output counts, required inputs and output 0 present, each attribute
    known and of the schema's type, required attributes present. A Python attribute dict cannot express the
    types (an int is accepted for a FLOAT attribute there), so :func:`ortpa.ops.validate.validate_model`
    calls this on the node before :func:`check_types`.
    """
    r = Rules(node, None)
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
        check_attr_type(attr_spec(name, r), name, found, r)
    for spec in PAGED_ATTENTION.attributes:
        if spec.required and spec.name not in attribute_types:
            r.fail("type.attribute", spec.name, f"Required attribute '{spec.name}' is missing.")
