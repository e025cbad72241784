"""The PagedAttention accept/reject matrix as data: a valid baseline per mode, one mutation per case.

Used by test_validate.py (ortpa's own rules) and test_validate_ort.py / test_validate_fuzz_ort.py (agreement
with ONNX Runtime, through :func:`node_model` and :func:`ort_verdict`).
An input spec is a shape (the formal's natural dtype: T for T/T_CACHE, int32 for S, float32 for scales),
``(shape, dtype)``, an ndarray (values matter), a ``TensorInfo`` (symbolic dims), or None (remove it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import onnx
from onnx import helper

from ortpa.ops.spec import PAGED_ATTENTION
from ortpa.ops.validate import TensorInfo, dtype_name

BF16 = ml_dtypes.bfloat16
FP8 = ml_dtypes.float8_e4m3fn
I32 = np.int32

# SEPARATE: 4 heads over 2 KV heads of 16, 5 tokens in 2 sequences, 4 blocks of 16, 2 blocks per sequence.
SEPARATE: dict[str, Any] = {
    "query": (5, 64),
    "key": (5, 32),
    "value": (5, 32),
    "key_cache": (4, 16, 2, 16),
    "value_cache": (4, 16, 2, 16),
    "cumulative_sequence_length": np.array([0, 2, 5], I32),
    "past_seqlens": np.array([0, 3], I32),
    "block_table": np.array([[0, 1], [2, 3]], I32),
}
SEPARATE_ATTRS = {"num_heads": 4, "kv_num_heads": 2}
PACKED = {**SEPARATE, "query": (5, 128), "key": None, "value": None}
# LATENT: 4 heads over one 32-wide latent row, v_head_size 16, 3 tokens in 1 sequence.
LATENT: dict[str, Any] = {
    "query": (3, 128),
    "key": (3, 32),
    "key_cache": (2, 16, 1, 32),
    "cumulative_sequence_length": np.array([0, 3], I32),
    "past_seqlens": np.array([0], I32),
    "block_table": np.array([[0, 1]], I32),
}
LATENT_ATTRS = {"num_heads": 4, "kv_num_heads": 1, "kv_cache_layout": "LATENT", "v_head_size": 16, "scale": 0.125}
BASES = {
    "separate": (SEPARATE, SEPARATE_ATTRS),
    "packed": (PACKED, SEPARATE_ATTRS),
    "latent": (LATENT, LATENT_ATTRS),
}


@dataclass(frozen=True)
class Case:
    id: str
    rule: str | None  # None: accepted
    base: str
    inputs: dict[str, Any] = field(default_factory=dict)
    attrs: dict[str, Any] = field(default_factory=dict)
    text: str = ""  # ONNX Runtime's message, or a part of it
    kwargs: dict[str, Any] = field(default_factory=dict)
    num_outputs: int = 1  # output slots, for the schema rules

    @property
    def symbolic(self) -> bool:
        return any(isinstance(v, TensorInfo) for v in self.inputs.values())


def build(case: Case, t_dtype: Any = np.float16) -> tuple[dict[str, Any], dict[str, Any]]:
    """The case's (inputs, attrs): baseline updated by the case, specs turned into arrays/stand-ins."""
    base_inputs, base_attrs = BASES[case.base]
    specs = {**base_inputs, **case.inputs}
    attrs = {k: v for k, v in {**base_attrs, **case.attrs}.items() if v is not None}
    natural = {"T": t_dtype, "T_CACHE": t_dtype, "S": I32, "T_KV_SCALE": np.float32}
    inputs = {}
    for f in PAGED_ATTENTION.inputs:
        spec = specs.get(f.name)
        if spec is None:
            continue
        if isinstance(spec, (np.ndarray, TensorInfo)):
            inputs[f.name] = spec
        elif len(spec) == 2 and isinstance(spec[0], tuple):
            inputs[f.name] = _zeros(spec[0], spec[1])
        else:
            inputs[f.name] = _zeros(spec, natural[f.type_param])
    return inputs, attrs


def _zeros(shape: tuple, dtype: Any) -> Any:
    if np.prod(shape, dtype=np.float64) > 1e6:
        return TensorInfo(tuple(shape), dtype)  # never allocate a huge array
    return np.zeros(shape, dtype)


def _c(id: str, rule: str | None, base: str, inputs=None, attrs=None, text="", **kw) -> Case:
    return Case(id, rule, base, dict(inputs or {}), dict(attrs or {}), text, **kw)


INT8_Q = {"key_cache": ((4, 16, 2, 16), np.int8), "value_cache": ((4, 16, 2, 16), np.int8)}
INT8_PT = {**INT8_Q, "k_scale": (1,), "v_scale": (1,)}
PT = {"k_quant_type": "PER_TENSOR", "v_quant_type": "PER_TENSOR"}
ROPE = {"cos_cache": (32, 8), "sin_cache": (32, 8)}
INT4 = {
    "key_cache": ((4, 16, 2, 8), np.uint8),
    "value_cache": ((4, 16, 2, 8), np.uint8),
    "k_scale": (1,),
    "v_scale": (1,),
}
INT4_ATTRS = {**PT, "k_cache_dtype": "int4", "v_cache_dtype": "int4"}
SYM = "sym"

ACCEPT = [
    _c("separate", None, "separate"),
    _c("packed", None, "packed"),
    _c("latent", None, "latent"),
    _c(
        "mha",
        None,
        "separate",
        {"key": (5, 64), "value": (5, 64), "key_cache": (4, 16, 4, 16), "value_cache": (4, 16, 4, 16)},
        {"kv_num_heads": 4},
    ),
    _c("int8-per-tensor", None, "separate", INT8_PT, PT),
    _c(
        "int8-per-channel",
        None,
        "separate",
        {**INT8_Q, "k_scale": (2, 1, 16), "v_scale": (2, 16)},
        {"k_quant_type": "per_channel", "v_quant_type": "PER_CHANNEL"},
    ),
    _c(
        "fp8",
        None,
        "separate",
        {"key_cache": ((4, 16, 2, 16), FP8), "value_cache": ((4, 16, 2, 16), FP8), "k_scale": (1,), "v_scale": (1,)},
        {**PT, "k_cache_dtype": "float8e4m3fn"},
    ),
    _c("int4", None, "separate", INT4, INT4_ATTRS),
    _c(
        "latent-int8",
        None,
        "latent",
        {"key_cache": ((2, 16, 1, 32), np.int8), "k_scale": (1, 1, 32)},
        {"k_quant_type": "PER_CHANNEL"},
    ),
    _c("rope", None, "separate", ROPE, {"do_rotary": 1, "rotary_interleaved": 1}),
    _c(
        "rope-partial-offset",
        None,
        "latent",
        {"cos_cache": (8, 8), "sin_cache": (8, 8)},
        {"do_rotary": 1, "rotary_offset": 16},
    ),
    _c("rope-caches-without-do-rotary", None, "separate", ROPE),
    _c(
        "all-extras",
        None,
        "separate",
        {
            "slot_mapping": (5,),
            "head_sink": (4,),
            "q_norm_weight": (16,),
            "k_norm_weight": (16,),
            "attention_metadata": np.array([3, 20, 3], I32),
        },
        {"softcap": 30.0, "local_window_size": 8, "is_causal": 0},
    ),
    _c("metadata-2", None, "separate", {"attention_metadata": np.array([0, 0], I32)}),
    _c(
        "zero-tokens-zero-blocks",
        None,
        "separate",
        {
            "query": (0, 64),
            "key": (0, 32),
            "value": (0, 32),
            "key_cache": (0, 16, 2, 16),
            "value_cache": (0, 16, 2, 16),
        },
    ),
    _c("huge-cache", None, "separate", {"key_cache": (1 << 20, 256, 2, 16), "value_cache": (1 << 20, 256, 2, 16)}),
    _c(
        "no-threads-limit",
        None,
        "separate",
        {"query": (5, 2048 * 16), "key": (5, 2 * 16), "value": (5, 2 * 16)},
        {"num_heads": 2048},
        kwargs={"max_threads_per_block": 0},
    ),
    _c(
        "quant-type-case-insensitive",
        None,
        "separate",
        INT8_PT,
        {"k_quant_type": "per_tensor", "v_quant_type": "Per_Tensor"},
    ),
]

REJECT = [
    # graph resolution: types and attributes
    _c("no-query", "type.required", "separate", {"query": None}, text="Required input 'query'"),
    _c(
        "unknown-attr",
        "type.attribute",
        "separate",
        attrs={"foo": 1},
        text="Unrecognized attribute: foo for operator PagedAttention",
    ),
    _c(
        "float-num-heads",
        "type.attribute",
        "separate",
        attrs={"num_heads": 4.0},
        text="Mismatched attribute type in 'n : num_heads'. Expected: 'INT', actual: 'FLOAT'",
    ),
    _c(
        "fp32-query",
        "type.T",
        "separate",
        {"query": ((5, 64), np.float32)},
        text="Type Error: Type 'tensor(float)' of input parameter (query) of operator (PagedAttention) in node (",
    ),
    _c(
        "mixed-T",
        "type.T.bind",
        "separate",
        {"query": ((5, 64), np.float16), "key": ((5, 32), BF16)},
        text="Type Error: Type parameter (T) of Optype (PagedAttention) bound to different types (",
    ),
    _c(
        "int32-cache",
        "type.T_CACHE",
        "separate",
        {"key_cache": ((4, 16, 2, 16), np.int32)},
        text="Type Error: Type 'tensor(int32)' of input parameter (key_cache)",
    ),
    _c(
        "mixed-cache",
        "type.T_CACHE.bind",
        "separate",
        {"value_cache": ((4, 16, 2, 16), np.int8)},
        text="Type parameter (T_CACHE) of Optype (PagedAttention) bound to different types",
    ),
    _c(
        "int64-cum",
        "type.S",
        "separate",
        {"cumulative_sequence_length": np.array([0, 2, 5], np.int64)},
        text="Type 'tensor(int64)' of input parameter (cumulative_sequence_length)",
    ),
    _c(
        "fp16-scale",
        "type.T_KV_SCALE",
        "separate",
        {**INT8_Q, "k_scale": ((1,), np.float16), "v_scale": (1,)},
        PT,
        text="Type 'tensor(float16)' of input parameter (k_scale)",
    ),
    # constructor
    _c("no-num-heads", "ctor.num_heads", "separate", attrs={"num_heads": None}, text="num_heads > 0 was false"),
    _c("zero-num-heads", "ctor.num_heads", "separate", attrs={"num_heads": 0}, text="num_heads > 0 was false"),
    _c(
        "kv-not-dividing",
        "ctor.kv_num_heads",
        "separate",
        attrs={"kv_num_heads": 3},
        text="num_heads % kv_num_heads == 0 was false",
    ),
    _c("kv-zero", "ctor.kv_num_heads", "separate", attrs={"kv_num_heads": 0}, text="kv_num_heads > 0"),
    _c(
        "eps-zero",
        "ctor.qk_norm_epsilon",
        "separate",
        attrs={"qk_norm_epsilon": 0.0},
        text="qk_norm_epsilon must be a positive finite number",
    ),
    _c(
        "eps-inf",
        "ctor.qk_norm_epsilon",
        "separate",
        attrs={"qk_norm_epsilon": float("inf")},
        text="qk_norm_epsilon must be a positive finite number",
    ),
    _c(
        "bad-quant",
        "ctor.quant_type",
        "separate",
        attrs={"v_quant_type": "PER_BLOCK"},
        text="Invalid KV quantization type: 'PER_BLOCK'. Valid values are: NONE, PER_TENSOR, PER_CHANNEL",
    ),
    _c(
        "bad-cache-dtype",
        "ctor.cache_dtype",
        "separate",
        attrs={"k_cache_dtype": "uint8"},
        text="Invalid KV cache data type: 'uint8'. Valid values are: '' (use the cache tensor's element type), "
        "float16, bfloat16, int8, float8e4m3fn, int4, float4e2m1. Unsigned types are excluded because "
        "quantization here is symmetric with no zero point.",
    ),
    _c(
        "lowercase-layout",
        "ctor.kv_cache_layout",
        "separate",
        attrs={"kv_cache_layout": "latent"},
        text="'kv_cache_layout' must be 'SEPARATE' or 'LATENT', got 'latent'",
    ),
    _c(
        "neg-v-head",
        "ctor.v_head_size",
        "separate",
        attrs={"v_head_size": -1},
        text="'v_head_size' must be non-negative, got -1",
    ),
    _c(
        "neg-rotary-offset",
        "ctor.rotary_offset",
        "separate",
        attrs={"rotary_offset": -8},
        text="'rotary_offset' must be non-negative, got -8",
    ),
    # §1.1
    _c(
        "too-many-heads",
        "1.1.1",
        "separate",
        {"query": (5, 2048 * 16), "key": (5, 32), "value": (5, 32)},
        {"num_heads": 2048},
        text="num_heads should be no larger than 1024",
    ),
    _c(
        "helper-kv-not-dividing",
        "1.1.2",
        "separate",
        attrs={"kv_num_heads": 3},
        text="num_heads must be a multiple of kv_num_heads. Got num_heads % kv_num_heads == 1",
        kwargs={"constructor_checks": False},
    ),
    # §1.2 LATENT
    _c(
        "latent-no-key",
        "1.2.latent.1",
        "latent",
        {"key": None},
        text="Input 'key' is required when 'kv_cache_layout' is 'LATENT'.",
    ),
    _c(
        "latent-value",
        "1.2.latent.2",
        "latent",
        {"value": (3, 32)},
        text="Input 'value' must be absent when 'kv_cache_layout' is 'LATENT': the value of every head is the "
        "leading 'v_head_size' channels of the latent key.",
    ),
    _c(
        "latent-q-rank",
        "1.2.latent.3",
        "latent",
        {"query": (3, 128, 1)},
        text="Input 'query' is expected to have 2 dimensions, got 3",
    ),
    _c(
        "latent-q-div",
        "1.2.latent.4",
        "latent",
        {"query": (3, 130)},
        text="Input 'query' hidden size must be a multiple of num_heads. Got 130 % 4 == 2",
    ),
    _c(
        "latent-head-8",
        "1.2.latent.5",
        "latent",
        {"query": (3, 48)},
        text="head_size must be a multiple of 8. Got head_size % 8 == 4",
    ),
    _c(
        "latent-k-rank",
        "1.2.latent.6",
        "latent",
        {"key": (3, 32, 1)},
        text="Input 'key' is expected to have 2 dimensions, got 3",
    ),
    _c(
        "latent-k-tokens",
        "1.2.latent.7",
        "latent",
        {"key": (2, 32)},
        text="Input 'query' and 'key' shall have same dim 0 (token count)",
    ),
    _c(
        "latent-k-hidden",
        "1.2.latent.8",
        "latent",
        {"key": (3, 16)},
        text="Input 'key' is expected to have hidden size kv_num_heads * head_size = 32 in 'LATENT' mode, got 16",
    ),
    # §1.2 SEPARATE
    _c(
        "sep-q-rank",
        "1.2.separate.1",
        "separate",
        {"query": (5, 64, 1)},
        text="Input 'query' is expected to have 2 dimensions, got 3",
    ),
    _c(
        "sep-head-8",
        "1.2.separate.2",
        "separate",
        {"query": (5, 48)},
        text="head_size must be a multiple of 8. Got head_size % 8 == 4",
    ),
    _c(
        "sep-no-value",
        "1.2.separate.3",
        "separate",
        {"value": None},
        text="Input 'key' and 'value' shall be both present, or both absent in the case of packed qkv.",
    ),
    _c(
        "sep-k-rank",
        "1.2.separate.4a",
        "separate",
        {"key": (5, 32, 1)},
        text="Input 'key' is expected to have 2 dimensions, got 3",
    ),
    _c(
        "sep-k-tokens",
        "1.2.separate.4b",
        "separate",
        {"key": (4, 32)},
        text="Input 'query' and 'key' shall have same dim 0 (token count)",
    ),
    _c(
        "sep-kv-div",
        "1.2.separate.5a",
        "separate",
        {"key": (5, 33)},
        text="kv_hidden_size must be a multiple of kv_num_heads. Got kv_hidden_size % kv_num_heads == 1",
    ),
    _c(
        "sep-kv-head",
        "1.2.separate.5b",
        "separate",
        {"key": (5, 64)},
        text="kv_hidden_size / kv_num_heads must be equal to head_size. Got kv_hidden_size / kv_num_heads == 32",
    ),
    _c(
        "sep-v-rank",
        "1.2.separate.6a",
        "separate",
        {"value": (5, 32, 1)},
        text="Input 'value' is expected to have 2 dimensions, got 3",
    ),
    _c(
        "sep-v-tokens",
        "1.2.separate.6b",
        "separate",
        {"value": (4, 32)},
        text="Input 'query' and 'value' shall have same dim 0 (token count)",
    ),
    _c(
        "sep-v-hidden",
        "1.2.separate.6c",
        "separate",
        {"value": (5, 16)},
        text="Input 'value' is expected to have same hidden size as key.",
    ),
    # §1.2 packed
    _c(
        "packed-rank",
        "1.2.packed.1",
        "packed",
        {"query": (5, 128, 1)},
        text="Input 'query' is expected to have 2 dimensions, got 3",
    ),
    _c(
        "packed-head-8",
        "1.2.packed.2",
        "packed",
        {"query": (5, 96)},
        text="head_size must be a multiple of 8. Got head_size % 8 == 4",
    ),
    _c(
        "packed-with-value",
        "1.2.packed.3",
        "packed",
        {"value": (5, 32)},
        text="Input 'key' and 'value' shall be both present, or both absent in the case of packed qkv.",
    ),
    # §1.3
    _c(
        "v-head-too-big",
        "1.3.1",
        "latent",
        attrs={"v_head_size": 64},
        text="'v_head_size' must be 0 (meaning head_size) or in [1, head_size] = [1, 32], got 64",
    ),
    _c(
        "v-head-separate",
        "1.3.2",
        "separate",
        attrs={"v_head_size": 8, "scale": 0.5},
        text="'v_head_size' (8) may only differ from head_size (16) when 'kv_cache_layout' is 'LATENT'.",
    ),
    _c(
        "no-scale",
        "1.3.3",
        "latent",
        attrs={"scale": None},
        text="An explicit 'scale' attribute is required when 'v_head_size' (16) differs from head_size (32): the "
        "default 1/sqrt(head_size) is not the intended scale for absorbed MLA.",
    ),
    _c("zero-scale", "1.3.3", "latent", attrs={"scale": 0.0}, text="An explicit 'scale' attribute is required"),
    # §1.4
    _c(
        "latent-value-cache",
        "1.4.latent.1",
        "latent",
        {"value_cache": (2, 16, 1, 32)},
        text="Input 'value_cache' must be absent when 'kv_cache_layout' is 'LATENT': the value cache is the "
        "leading 'v_head_size' channels of 'key_cache'.",
    ),
    _c(
        "latent-kv-heads",
        "1.4.latent.2",
        "latent",
        {"key": (3, 64)},
        {"kv_num_heads": 2},
        text="'kv_num_heads' must be 1 when 'kv_cache_layout' is 'LATENT', got 2",
    ),
    _c(
        "latent-sink",
        "1.4.latent.3",
        "latent",
        {"head_sink": (4,)},
        text="Input 'head_sink' is not supported when 'kv_cache_layout' is 'LATENT'.",
    ),
    _c(
        "latent-norm",
        "1.4.latent.4",
        "latent",
        {"k_norm_weight": (32,)},
        text="Inputs 'q_norm_weight' / 'k_norm_weight' are not supported when 'kv_cache_layout' is 'LATENT': "
        "DeepSeek normalizes the latent projections in the graph, before absorption.",
    ),
    _c(
        "latent-v-quant",
        "1.4.latent.5",
        "latent",
        attrs={"v_cache_dtype": "float16"},
        text="Input 'v_scale' and attributes 'v_quant_type' / 'v_cache_dtype' must be unset when 'kv_cache_layout' "
        "is 'LATENT': the value elements are the key elements, so 'k_scale' and 'k_cache_dtype' describe both.",
    ),
    _c(
        "sep-no-value-cache",
        "1.4.separate.1",
        "separate",
        {"value_cache": None},
        text="Input 'value_cache' is required unless 'kv_cache_layout' is 'LATENT'.",
    ),
    # §1.5
    _c(
        "kc-rank",
        "1.5.1",
        "separate",
        {"key_cache": (4, 16, 32)},
        text="Input 'key_cache' is expected to have 4 dimensions, got 3",
    ),
    _c(
        "block-24",
        "1.5.2",
        "separate",
        {"key_cache": (4, 24, 2, 16), "value_cache": (4, 24, 2, 16)},
        text="block_size must be a power of two and at least 16. Got block_size == 24",
    ),
    _c(
        "block-8",
        "1.5.2",
        "separate",
        {"key_cache": (4, 8, 2, 16), "value_cache": (4, 8, 2, 16)},
        text="Got block_size == 8",
    ),
    _c(
        "kc-heads",
        "1.5.3",
        "separate",
        {"key_cache": (4, 16, 4, 16)},
        text="Input 'key_cache' shall have kv_num_heads, got 4",
    ),
    _c(
        "kc-head-size",
        "1.5.4",
        "separate",
        {"key_cache": (4, 16, 2, 8)},
        text="Input 'key_cache' dimension 3 should be same as head_size, got 8",
    ),
    _c(
        "vc-rank",
        "1.5.6",
        "separate",
        {"value_cache": (4, 16, 32)},
        text="Input 'value_cache' is expected to have 4 dimensions, got 3",
    ),
    _c(
        "vc-blocks",
        "1.5.7a",
        "separate",
        {"value_cache": (3, 16, 2, 16)},
        text="Input 'value_cache' dimension 0 should be num_blocks, got 3",
    ),
    _c(
        "vc-block-size",
        "1.5.7b",
        "separate",
        {"value_cache": (4, 32, 2, 16)},
        text="Input 'value_cache' dimension 1 should be block_size, got 32",
    ),
    _c(
        "vc-heads",
        "1.5.8",
        "separate",
        {"value_cache": (4, 16, 3, 16)},
        text="Input 'key_cache' and 'value_cache' dimension 2 (kv num heads) should be the same, got 2 and 3",
    ),
    # 1.5.9 / 1.5.11 / 1.9.3 follow from earlier rules for concrete shapes; a symbolic key_cache dim reaches them
    _c(
        "vc-heads-sym",
        "1.5.9",
        "separate",
        {"key_cache": TensorInfo((4, 16, SYM, 16), np.float16), "value_cache": (4, 16, 3, 16)},
        text="Input 'value_cache' shall have kv_num_heads, got 3",
    ),
    _c(
        "vc-head-size",
        "1.5.10",
        "separate",
        {"value_cache": (4, 16, 2, 8)},
        text="Input 'key_cache' and 'value_cache' dimension 3 (head size) should be the same, got 16 and 8",
    ),
    _c(
        "vc-head-size-sym",
        "1.5.11",
        "separate",
        {"key_cache": TensorInfo((4, 16, 2, SYM), np.float16), "value_cache": (4, 16, 2, 8)},
        text="Input 'value_cache' dimension 3 should be same as head_size, got 8",
    ),
    # §1.6
    _c(
        "cum-short",
        "1.6.1",
        "separate",
        {"cumulative_sequence_length": np.array([0], I32)},
        text="cumulative_sequence_length must be shape (batch_size + 1).",
    ),
    _c(
        "cum-2d",
        "1.6.1",
        "separate",
        {"cumulative_sequence_length": (3, 1)},
        text="cumulative_sequence_length must be shape (batch_size + 1).",
    ),
    _c("past-len", "1.6.2", "separate", {"past_seqlens": (3,)}, text="seqlens must be shape (batch_size)."),
    _c("bt-rank", "1.6.3", "separate", {"block_table": (2, 2, 1)}, text="block_table must be 2D."),
    _c(
        "bt-batch",
        "1.6.4",
        "separate",
        {"block_table": (3, 2)},
        text="block_table dimension 0 should be batch_size, got 3",
    ),
    _c("bt-width", "1.6.5", "separate", {"block_table": (2, 0)}, text="dimension 1 must be positive"),
    _c(
        "slot-rank",
        "1.6.6",
        "separate",
        {"slot_mapping": (5, 1)},
        text="Input 'slot_mapping' is expected to have 1 dimension, got 2",
    ),
    _c(
        "slot-len",
        "1.6.7",
        "separate",
        {"slot_mapping": (4,)},
        text="Input 'slot_mapping' dimension 0 should be token_count (5), got 4",
    ),
    # §1.7
    _c("sink-rank", "1.7.1", "separate", {"head_sink": (4, 1)}, text="head_sink must be a 1D tensor"),
    _c(
        "sink-len",
        "1.7.2",
        "separate",
        {"head_sink": (3,)},
        text="head_sink dimension 0 must be equal to the num heads, got 3",
    ),
    _c(
        "norm-alone",
        "1.7.3",
        "separate",
        {"q_norm_weight": (16,)},
        text="Input 'q_norm_weight' and 'k_norm_weight' must be provided together.",
    ),
    _c(
        "q-norm-shape",
        "1.7.4",
        "separate",
        {"q_norm_weight": (8,), "k_norm_weight": (16,)},
        text="Input 'q_norm_weight' must be a 1D tensor of shape (head_size) = (16).",
    ),
    _c(
        "k-norm-shape",
        "1.7.5",
        "separate",
        {"q_norm_weight": (16,), "k_norm_weight": (16, 1)},
        text="Input 'k_norm_weight' must be a 1D tensor of shape (head_size) = (16).",
    ),
    _c(
        "helper-eps",
        "1.7.6",
        "separate",
        {"q_norm_weight": (16,), "k_norm_weight": (16,)},
        {"qk_norm_epsilon": -1.0},
        text="qk_norm_epsilon must be positive, got -1",
        kwargs={"constructor_checks": False},
    ),
    _c(
        "rope-head-16",
        "1.7.7",
        "separate",
        {
            "query": (5, 96),
            "key": (5, 48),
            "value": (5, 48),
            "key_cache": (4, 16, 2, 24),
            "value_cache": (4, 16, 2, 24),
            **ROPE,
        },
        text="head_size shall be a multiple of 16. Got head_size % 16 == 8",
    ),
    _c(
        "cos-rank",
        "1.7.rank",
        "separate",
        {"cos_cache": (32, 8, 1), "sin_cache": (32, 8)},
        text="Input 'cos_cache' is expected to have 2 dimensions, got 3",
    ),
    _c(
        "cos-wide",
        "1.7.8",
        "separate",
        {"cos_cache": (32, 16), "sin_cache": (32, 16)},
        text="cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8.",
    ),
    _c(
        "sin-odd",
        "1.7.9",
        "separate",
        {"cos_cache": (32, 8), "sin_cache": (32, 4)},
        text="sin_cache dimension 1 must be <= head_size / 2 and a multiple of 8.",
    ),
    _c(
        "cos-sin-differ",
        "1.7.10",
        "latent",
        {"cos_cache": (32, 16), "sin_cache": (32, 8)},
        text="cos_cache and sin_cache dimension 1 must be the same.",
    ),
    _c(
        "cos-alone",
        "1.7.11",
        "separate",
        {"cos_cache": (32, 8)},
        text="Input 'cos_cache' and 'sin_cache' shall be both present or both absent.",
    ),
    _c(
        "offset-4",
        "1.7.12",
        "separate",
        attrs={"rotary_offset": 4},
        text="'rotary_offset' must be non-negative and a multiple of 8, got 4",
    ),
    _c(
        "offset-overflow",
        "1.7.13",
        "separate",
        ROPE,
        {"rotary_offset": 8, "do_rotary": 1},
        text="'rotary_offset' + rotary_dim must not exceed head_size. Got 8 + 16 > 16",
    ),
    # §1.8
    _c(
        "scale-without-quant",
        "1.8.1",
        "separate",
        {"k_scale": (1,)},
        text="Input 'k_scale' must not be provided when 'k_quant_type' is 'NONE'.",
    ),
    _c(
        "int8-no-quant",
        "1.8.2",
        "separate",
        INT8_Q,
        text="The KV cache has a quantized element type, so 'k_quant_type' must be 'PER_TENSOR' or 'PER_CHANNEL'.",
    ),
    _c(
        "int8-no-v-quant",
        "1.8.2",
        "separate",
        {**INT8_Q, "k_scale": (1,)},
        {"k_quant_type": "PER_TENSOR"},
        text="so 'v_quant_type' must be 'PER_TENSOR' or 'PER_CHANNEL'.",
    ),
    _c(
        "quant-fp16",
        "1.8.3",
        "separate",
        {"k_scale": (1,)},
        {"k_quant_type": "PER_TENSOR"},
        text="'k_quant_type' is set, but the KV cache element type is not quantized. Use an int8 or float8e4m3fn "
        "cache, or set 'k_quant_type' to 'NONE'.",
    ),
    _c(
        "quant-no-scale",
        "1.8.4",
        "separate",
        INT8_Q,
        PT,
        text="Input 'k_scale' is required when 'k_quant_type' is not 'NONE'.",
    ),
    _c(
        "per-tensor-2",
        "1.8.5",
        "separate",
        {**INT8_PT, "v_scale": (2,)},
        PT,
        text="Input 'v_scale' must have exactly 1 element for PER_TENSOR quantization, got 2",
    ),
    _c(
        "per-channel-shape",
        "1.8.6",
        "separate",
        {**INT8_Q, "k_scale": (2, 1, 8)},
        {"k_quant_type": "PER_CHANNEL"},
        text="Input 'k_scale' must have shape (kv_num_heads, 1, head_size) = (2, 1, 16) for PER_CHANNEL "
        "quantization, got {2,1,8}",
    ),
    _c(
        "int4-on-fp16",
        "1.8.7",
        "separate",
        attrs={"k_cache_dtype": "int4"},
        text="'k_cache_dtype' == 'int4' requires a uint8 packed cache, which is not enabled in this build.",
    ),
    _c(
        "dtype-mismatch",
        "1.8.8",
        "separate",
        attrs={"v_cache_dtype": "bfloat16"},
        text="'v_cache_dtype' is 'bfloat16', but the cache tensor's element type is 'float16'. Leave the attribute "
        "at '' to use the tensor's element type.",
    ),
    _c(
        "metadata-4",
        "1.8.9",
        "separate",
        {"attention_metadata": (4,)},
        text="Input 'attention_metadata' must have shape (2) or (3), got {4}",
    ),
    # §1.9 INT4
    _c("uint8-unnamed", "1.9.1", "separate", INT4, PT, text="'k_cache_dtype' must be 'int4' for a uint8"),
    _c(
        "int4-unpacked",
        "1.9.2",
        "separate",
        {**INT4, "key_cache": ((4, 16, 2, 16), np.uint8)},
        INT4_ATTRS,
        text="Input 'key_cache' dimension 3 should be (head_size + 1) / 2 = 8 for a packed int4 cache, got 16",
    ),
    _c(
        "int4-v-unpacked-sym",
        "1.9.3",
        "separate",
        {**INT4, "key_cache": TensorInfo((4, 16, 2, SYM), np.uint8), "value_cache": ((4, 16, 2, 16), np.uint8)},
        INT4_ATTRS,
        text="Input 'value_cache' dimension 3 should be (head_size + 1) / 2 = 8 for a packed int4 cache, got 16",
    ),
    # §1.10
    _c(
        "rotary-no-caches",
        "1.10.1",
        "separate",
        attrs={"do_rotary": 1},
        text="cos_cache and sin_cache must be passed to PagedAttention when do_rotary = 1",
    ),
    _c(
        "no-blocks",
        "1.10.5",
        "separate",
        {"key_cache": (0, 16, 2, 16), "value_cache": (0, 16, 2, 16)},
        text="PagedAttention requires at least one physical cache block for non-empty input.",
    ),
    _c(
        "metadata-negative",
        "1.10.9.1",
        "separate",
        {"attention_metadata": np.array([-1, 0], I32)},
        text="PagedAttention: 'attention_metadata' entries must be non-negative, got [-1, 0, 0]. Use 0 for 'unknown'.",
    ),
    _c(
        "metadata-lower",
        "1.10.9.2",
        "separate",
        {"attention_metadata": np.array([0, 0, 100], I32)},
        text="PagedAttention: attention_metadata max_kv_len_lower_bound (100) must not exceed max_kv_len_bound (32).",
    ),
]

SCHEMA_REJECT = [
    _c(
        "s-layout",
        "schema.layout",
        "separate",
        attrs={"kv_cache_layout": "MLA"},
        text="kv_cache_layout must be 'SEPARATE' or 'LATENT'.",
    ),
    _c(
        "s-q-rank", "schema.query_rank", "separate", {"query": (5, 64, 1)}, text="Input 0 (query) shall be 2 dimensions"
    ),
    _c(
        "s-latent-heads",
        "schema.latent.num_heads",
        "latent",
        attrs={"num_heads": 0},
        text="num_heads must be a positive integer.",
    ),
    _c(
        "s-latent-div",
        "schema.latent.divisible",
        "latent",
        {"query": (3, 130)},
        text="Query hidden size must be divisible by num_heads.",
    ),
    _c(
        "s-latent-vhead",
        "schema.latent.v_head_size",
        "latent",
        attrs={"v_head_size": 64},
        text="v_head_size must not exceed head_size.",
    ),
    _c(
        "s-packed-sym",
        "schema.packed.heads",
        "packed",
        {"query": TensorInfo(("T", "H"), np.float16)},
        text="Invalid hidden size or number of heads. Hidden size, num_heads and kv_num_heads must be positive "
        "integers.",
    ),
    _c(
        "s-packed-div",
        "schema.packed.divisible",
        "packed",
        {"query": (5, 100)},
        text="Hidden size must be divisible by (num_heads + 2 * kv_num_heads).",
    ),
    _c(
        "s-latent-vc-out",
        "schema.outputs.latent",
        "latent",
        num_outputs=3,
        text="value_cache_out must be absent when kv_cache_layout is 'LATENT'.",
    ),
    _c(
        "s-one-out",
        "schema.outputs.both",
        "separate",
        num_outputs=2,
        text="Key cache and value cache output tensors must be both present or both absent.",
    ),
    _c(
        "s-vc-out-no-vc",
        "schema.outputs.value_cache",
        "separate",
        {"value_cache": None},
        num_outputs=3,
        text="value_cache is required when value_cache_out is present.",
    ),
    _c(
        "s-kc-rank",
        "schema.key_cache_rank",
        "separate",
        {"key_cache": (4, 16, 32)},
        num_outputs=3,
        text="The block-based KV cache inputs shall be 4 dimensions",
    ),
]


# ------------------------------------------------------------------------------------------ ONNX Runtime
def elem_type(dtype: Any) -> int:
    """The ONNX ``TensorProto`` element type of a numpy / ml_dtypes dtype or a dtype name."""
    name = dtype_name(dtype)
    return onnx.TensorProto.DataType.Value({"float32": "FLOAT", "float64": "DOUBLE"}.get(name, name.upper()))


def node_model(
    inputs: Mapping[str, Any], attrs: Mapping[str, Any], outputs: Sequence[str], *, name: str = "pa"
) -> onnx.ModelProto:
    """A one-node PagedAttention model: each given input is a graph input with its declared shape and type.

    ``inputs`` maps formal names to arrays or :class:`TensorInfo` (``shape`` None = unknown rank; a str dim is
    symbolic, a None dim unnamed); ``outputs`` are the node's output slots ("" = an absent optional output).
    """
    from ortpa.ops.spec import PAGED_ATTENTION

    graph_inputs, node_inputs = [], []
    for f in PAGED_ATTENTION.inputs:
        x = inputs.get(f.name)
        node_inputs.append(f.name if x is not None else "")
        if x is not None:
            shape = None if x.shape is None else list(x.shape)
            graph_inputs.append(helper.make_tensor_value_info(f.name, elem_type(x.dtype), shape))
    while node_inputs and not node_inputs[-1]:
        node_inputs.pop()
    node = helper.make_node("PagedAttention", node_inputs, list(outputs), domain="com.microsoft", name=name, **attrs)

    def _elem_of(*names: str) -> int:
        x = next((inputs[n] for n in names if inputs.get(n) is not None), None)
        return elem_type(BF16 if x is None else x.dtype)

    # output slot i has the type of query / key_cache / value_cache (an extra slot: any type, it fails anyway)
    by_slot = [("query",), ("key_cache",), ("value_cache", "key_cache")]
    graph_outputs = [
        helper.make_tensor_value_info(o, _elem_of(*(by_slot[i] if i < 3 else ())), None)
        for i, o in enumerate(outputs)
        if o
    ]
    graph = helper.make_graph([node], "g", graph_inputs, graph_outputs)
    opsets = [helper.make_opsetid("", 22), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def ort_verdict(model: onnx.ModelProto) -> tuple[str, str]:
    """Create a CPU session: ("kernel", text) when the node passed graph resolution, ("reject", text) if not.

    ONNX Runtime has no CPU kernel for PagedAttention, so a node that passes type binding and shape inference
    fails kernel lookup with NOT_IMPLEMENTED. A float16 node instead gets float32 casts inserted around it
    (InsertCastTransformer, after resolution), which then fail type binding on an ``InsertedPrecisionFreeCast_*``
    input: that too means the node as written passed resolution. ("accept", "") means a CPU kernel appeared.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        text = str(exc)
        kernel = "NOT_IMPLEMENTED" in text or "InsertedPrecisionFreeCast_" in text
        return ("kernel" if kernel else "reject"), text
    return "accept", ""
