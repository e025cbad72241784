"""The rule table: every rule id :func:`~ortpa.ops.validate.check_inputs` and the node checks can raise.

Ids are stable and name the reference's steps (``paged_attention_facts.md``): ``type.*`` graph-resolution type
binding, ``ctor.*`` the kernel constructor (§1.0), ``1.1.*`` … ``1.9.*`` ``paged_attention_helper::CheckInputs``
(``1.2.latent.3`` is step 3 of the LATENT Q/K check; ``a``/``b`` split a step with two messages), ``1.10.*``
the host-decidable ``ComputeInternal`` checks. Each maps to a one-line description. A rule id spelled anywhere
in this package must be declared here (``tests/ops/test_validate.py`` checks it).
"""

from __future__ import annotations

__all__ = ["RULES"]

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
