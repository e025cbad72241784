"""ortpa.ops.spec against the schema registered in the installed onnxruntime, field by field."""

from __future__ import annotations

import onnx
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import get_all_operator_schema

from ortpa.ops.spec import PAGED_ATTENTION

_OPTION = {"Single": False, "Optional": True}


def _registered():
    found = [s for s in get_all_operator_schema() if s.name == "PagedAttention" and s.domain == "com.microsoft"]
    assert len(found) == 1, f"expected one com.microsoft::PagedAttention schema, found {len(found)}"
    return found[0]


def _default(attr) -> object:
    raw = getattr(attr, "_default_value", b"")
    if not raw:
        return None
    value = onnx.helper.get_attribute_value(onnx.AttributeProto.FromString(raw))
    return value.decode() if isinstance(value, bytes) else value


def _ort_view() -> dict:
    s = _registered()
    return {
        "since_version": s.since_version,
        "attributes": {
            name: (str(a.type).rsplit(".", 1)[-1], bool(a.required), _default(a)) for name, a in s.attributes.items()
        },
        "inputs": [(i.name, i.typeStr, _OPTION[str(i.option).rsplit(".", 1)[-1]]) for i in s.inputs],
        "outputs": [(o.name, o.typeStr, _OPTION[str(o.option).rsplit(".", 1)[-1]]) for o in s.outputs],
        "type_constraints": {t.type_param_str: tuple(t.allowed_type_strs) for t in s.type_constraints},
    }


def _our_view() -> dict:
    return {
        "since_version": PAGED_ATTENTION.since_version,
        "attributes": {a.name: (a.type, a.required, a.schema_default) for a in PAGED_ATTENTION.attributes},
        "inputs": [(i.name, i.type_param, i.optional) for i in PAGED_ATTENTION.inputs],
        "outputs": [(o.name, o.type_param, o.optional) for o in PAGED_ATTENTION.outputs],
        "type_constraints": {t.param: t.allowed for t in PAGED_ATTENTION.type_constraints},
    }


def _diff(ours: dict, theirs: dict) -> list[str]:
    lines = []
    for key in ours:
        a, b = ours[key], theirs[key]
        if isinstance(a, dict):
            for name in sorted(set(a) | set(b)):
                if a.get(name) != b.get(name):
                    lines.append(f"{key}.{name}: ortpa={a.get(name)!r} onnxruntime={b.get(name)!r}")
        elif isinstance(a, list):
            for i in range(max(len(a), len(b))):
                x = a[i] if i < len(a) else None
                y = b[i] if i < len(b) else None
                if x != y:
                    lines.append(f"{key}[{i}]: ortpa={x!r} onnxruntime={y!r}")
        elif a != b:
            lines.append(f"{key}: ortpa={a!r} onnxruntime={b!r}")
    return lines


def test_spec_matches_installed_onnxruntime():
    diff = _diff(_our_view(), _ort_view())
    assert not diff, "PagedAttention schema changed in onnxruntime:\n" + "\n".join(diff)


def test_counts():
    assert len(PAGED_ATTENTION.attributes) == 16
    assert len(PAGED_ATTENTION.inputs) == 17
    assert len(PAGED_ATTENTION.outputs) == 3


def test_diff_is_readable_when_schema_changes():
    theirs = _ort_view()
    theirs["attributes"]["softcap"] = ("INT", False, None)
    theirs["inputs"] = theirs["inputs"][:-1]
    diff = _diff(_our_view(), theirs)
    assert any(line.startswith("attributes.softcap:") for line in diff)
    assert any("inputs[16]" in line and "attention_metadata" in line for line in diff)


def test_lookup_helpers():
    assert PAGED_ATTENTION.input_index("block_table") == 7
    assert PAGED_ATTENTION.allowed_types("S") == ("tensor(int32)",)
    with pytest.raises(KeyError, match="no input named"):
        PAGED_ATTENTION.input_index("nope")
    assert PAGED_ATTENTION.kernel_defaults()["qk_norm_epsilon"] == pytest.approx(1e-6)
