"""ortpa.ops.validate: every rule, accept and reject, with ONNX Runtime's wording; robustness; unchecked dims."""

from __future__ import annotations

import re
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from validate_cases import ACCEPT, REJECT, SCHEMA_REJECT, SYM, Case, build

import ortpa.ops.validate as validate
from ortpa.errors import InvalidArgument
from ortpa.ops.params import PagedAttentionParams
from ortpa.ops.spec import PAGED_ATTENTION
from ortpa.ops.validate import RULES, SCHEMA_RULES, TensorInfo, check_inputs, check_schema, dtype_name


def _run(case: Case, t_dtype=np.float16) -> PagedAttentionParams:
    inputs, attrs = build(case, t_dtype)
    return check_inputs(inputs, attrs, node="n", **case.kwargs)


@pytest.mark.parametrize("case", ACCEPT, ids=lambda c: c.id)
@pytest.mark.parametrize("t_dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_accepts(case: Case, t_dtype) -> None:
    params = _run(case, t_dtype)
    assert isinstance(params, PagedAttentionParams)
    assert params.activation_dtype == dtype_name(t_dtype)


@pytest.mark.parametrize("case", REJECT, ids=lambda c: c.id)
def test_rejects_with_ort_text(case: Case) -> None:
    with pytest.raises(InvalidArgument) as info:
        _run(case)
    err = info.value
    assert err.rule == case.rule, f"expected rule {case.rule}, got {err.rule}: {err.message}"
    assert case.text in err.message
    assert err.node == "n" and err.name  # where: node and offending input/attribute
    assert err.rule in RULES


@pytest.mark.parametrize("case", SCHEMA_REJECT, ids=lambda c: c.id)
def test_schema_rules(case: Case) -> None:
    inputs, attrs = build(case)
    with pytest.raises(InvalidArgument) as info:
        check_schema(inputs, attrs, case.num_outputs, node="n")
    assert info.value.rule == case.rule
    assert info.value.message == f"[ShapeInferenceError] {case.text}"


@pytest.mark.parametrize("case", ACCEPT, ids=lambda c: c.id)
def test_schema_accepts_valid(case: Case) -> None:
    inputs, attrs = build(case)
    check_schema(inputs, attrs, 1 if case.base == "latent" else 3, node="n")


def test_every_rule_is_hit_and_declared() -> None:
    declared = set(RULES) | set(SCHEMA_RULES)
    hit = {c.rule for c in REJECT + SCHEMA_REJECT}
    assert declared - hit == set(), f"rules without a rejecting case: {sorted(declared - hit)}"
    assert hit - declared == set(), f"cases naming undeclared rules: {sorted(hit - declared)}"
    # every rule id spelled in the sources is declared (a rule added to the code must be added to RULES)
    pattern = re.compile(r'"((?:type|ctor|schema)\.[\w.]+|1\.\d+\.[\w.]+)"')
    # the validate package is split by topic: scan every module of it, found on disk so a new one is scanned too
    sources = [*sorted(Path(validate.__file__).parent.glob("*.py"))]
    assert len(sources) > 2, sources
    for source in sources:
        spelled = set(pattern.findall(source.read_text()))
        spelled -= {"type.T_KV_SCALE.bind", "type.S.bind"}
        assert spelled <= declared, f"{source.name} raises undeclared rules {sorted(spelled - declared)}"


def test_derived_params() -> None:
    p = _run(ACCEPT[0])
    assert (p.batch_size, p.token_count, p.head_size, p.v_head_size, p.num_blocks, p.block_size) == (
        2,
        5,
        16,
        16,
        4,
        16,
    )
    assert p.max_blocks_per_seq == 2 and p.scale == pytest.approx(0.25) and not p.has_explicit_scale
    lat = _run(next(c for c in ACCEPT if c.id == "rope-partial-offset"))
    assert (lat.head_size, lat.v_head_size, lat.rotary_dim, lat.rotary_offset, lat.output_width) == (32, 16, 16, 16, 64)
    assert lat.is_latent and lat.scale == 0.125 and lat.v_cache_dtype == lat.k_cache_dtype == "float16"
    packed = _run(ACCEPT[1])
    assert packed.is_packed_qkv and packed.hidden_size == 64 and packed.kv_hidden_size == 32
    i4 = _run(next(c for c in ACCEPT if c.id == "int4"))
    assert i4.cache_storage_dtype == "int4" and i4.is_quantized_cache and i4.k_cache_dtype == "int4"


def test_dtype_spellings() -> None:
    for spelling in (np.float16, np.dtype("float16"), onnx.TensorProto.FLOAT16, "tensor(float16)"):
        assert dtype_name(spelling) == "float16"
    assert dtype_name(ml_dtypes.bfloat16) == dtype_name(onnx.TensorProto.BFLOAT16) == "bfloat16"
    assert dtype_name(ml_dtypes.float8_e4m3fn) == dtype_name(onnx.TensorProto.FLOAT8E4M3FN) == "float8e4m3fn"
    assert dtype_name(onnx.TensorProto.FLOAT) == dtype_name(np.float32) == "float32"
    assert dtype_name(None) is None and dtype_name(object()).startswith("unknown(")
    # ONNX elem-type ints and ml_dtypes go through check_inputs the same way as numpy dtypes
    inputs, attrs = build(ACCEPT[0])
    inputs = {k: TensorInfo(v.shape, onnx.helper.np_dtype_to_tensor_dtype(v.dtype)) for k, v in inputs.items()}
    assert check_inputs(inputs, attrs).cache_storage_dtype == "float16"


def test_symbolic_dims_are_unchecked_not_passed() -> None:
    inputs, attrs = build(ACCEPT[0])
    inputs["query"] = TensorInfo(("num_tokens", 64), np.float16)
    inputs["key"] = TensorInfo(("num_tokens", 32), np.float16)
    inputs["value"] = TensorInfo(("other", 32), np.float16)
    inputs["key_cache"] = TensorInfo(("num_blocks", 16, 2, 16), np.float16)
    inputs["value_cache"] = TensorInfo(("num_blocks", 16, 2, None), np.float16)
    inputs["slot_mapping"] = TensorInfo(("num_tokens",), np.int32)
    unchecked: list = []
    p = check_inputs(inputs, attrs, unchecked=unchecked)
    rules = {r for r, _ in unchecked}
    # the same symbol on both sides decides equality (4b, 1.5.7a, 1.6.7); different or unnamed dims do not
    assert rules == {"1.2.separate.6b", "1.5.10", "1.5.11", "1.10.5"}, unchecked
    assert p.token_count is None and p.num_blocks is None and p.head_size == 16
    assert all(reason for _, reason in unchecked)


def test_unknown_rank_and_dtype_are_unchecked() -> None:
    inputs, attrs = build(REJECT[0].__class__("x", None, "latent"))
    inputs["query"] = TensorInfo(None, None)
    unchecked: list = []
    p = check_inputs(inputs, attrs, unchecked=unchecked)
    rules = {r for r, _ in unchecked}
    assert {"type.T", "1.2.latent.3", "1.2.latent.4"} <= rules
    assert p.head_size is None and p.hidden_size is None and p.scale == 0.125


def test_symbolic_rule_still_rejects_what_is_known() -> None:
    inputs, attrs = build(ACCEPT[0])
    inputs["key_cache"] = TensorInfo((SYM, 24, 2, 16), np.float16)
    with pytest.raises(InvalidArgument, match="block_size == 24"):
        check_inputs(inputs, attrs)


def test_zero_tokens_skip_block_check() -> None:
    case = next(c for c in ACCEPT if c.id == "zero-tokens-zero-blocks")
    p = _run(case)
    assert p.token_count == 0 and p.num_blocks == 0


# ------------------------------------------------------------------------------------------ robustness
_DIMS = st.one_of(
    st.sampled_from([0, 1, 2, 3, 4, 8, 15, 16, 24, 32, 48, 64, 128, 2**31, 2**62]),
    st.integers(-3, 300),
    st.sampled_from(["n", "T", "", None]),
)
_SHAPES = st.one_of(st.none(), st.lists(_DIMS, min_size=0, max_size=5).map(tuple))
_DTYPES = st.sampled_from(
    [np.float16, ml_dtypes.bfloat16, np.float32, np.int8, np.uint8, np.int32, np.int64, ml_dtypes.float8_e4m3fn,
     onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16, onnx.TensorProto.INT32, 999, -1, "tensor(float16)",
     "garbage", None, object()]
)  # fmt: skip
_ATTR_VALUES = st.one_of(
    st.integers(-(2**40), 2**40),
    st.sampled_from([0, 1, -1, 2, 4, 8, 16, 1024, 4096]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(["", "NONE", "PER_TENSOR", "per_channel", "SEPARATE", "LATENT", "int4", "int8", "x", b"LATENT"]),
    st.none(),
    st.lists(st.integers(), max_size=2),
)
_ATTR_NAMES = st.sampled_from([a.name for a in PAGED_ATTENTION.attributes] + ["bogus"])


@st.composite
def _garbage(draw):
    names = PAGED_ATTENTION.input_names
    inputs = {}
    for name in names:
        if draw(st.booleans()) or name in ("query", "key_cache"):
            inputs[name] = TensorInfo(draw(_SHAPES), draw(_DTYPES))
    if draw(st.booleans()):
        inputs["attention_metadata"] = np.array(draw(st.lists(st.integers(-5, 50), min_size=0, max_size=4)), np.int32)
    attrs = draw(st.dictionaries(_ATTR_NAMES, _ATTR_VALUES, max_size=6))
    if draw(st.booleans()):
        attrs.setdefault("num_heads", draw(st.sampled_from([1, 2, 4, 8])))
        attrs.setdefault("kv_num_heads", draw(st.sampled_from([1, 2, 4])))
    return inputs, attrs


@given(_garbage(), st.integers(0, 3), st.booleans())
def test_garbage_only_raises_invalid_argument(case, n_outputs, ctor) -> None:
    inputs, attrs = case
    for fn in (
        lambda: check_inputs(inputs, attrs, unchecked=[], constructor_checks=ctor),
        lambda: check_schema(inputs, attrs, n_outputs),
    ):
        try:
            fn()
        except InvalidArgument as exc:
            assert exc.rule in RULES or exc.rule in SCHEMA_RULES, exc.rule
            assert exc.message


@given(st.sampled_from(ACCEPT + REJECT), st.sampled_from(PAGED_ATTENTION.input_names), _SHAPES)
def test_mutating_one_shape_only_raises_invalid_argument(case, name, shape) -> None:
    inputs, attrs = build(case)
    inputs[name] = TensorInfo(shape, np.float16)
    try:
        check_inputs(inputs, attrs, unchecked=[], **case.kwargs)
    except InvalidArgument as exc:
        assert exc.rule in RULES
