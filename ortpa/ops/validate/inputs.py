"""``check_inputs``: ONNX Runtime's PagedAttention input rules end to end, in the kernel's order.

Type binding (:mod:`.signature`), the constructor (:mod:`.attrs`), then ``paged_attention_helper::CheckInputs``
section by section (:mod:`.heads` §1.1–§1.3, :mod:`.cache` §1.4–§1.6, :mod:`.extras` §1.7, :mod:`.quant`
§1.8–§1.9) and the host-decidable ``ComputeInternal`` checks (:mod:`.compute` §1.8.9, §1.10); the first
broken rule raises, and the derived :class:`~ortpa.ops.params.PagedAttentionParams` are returned.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ortpa.ops.params import PagedAttentionParams
from ortpa.ops.spec import PAGED_ATTENTION
from ortpa.ops.validate.attrs import check_constructor
from ortpa.ops.validate.cache import check_kv_cache, check_layout, check_sequences
from ortpa.ops.validate.checks import Rules, present, shape_of
from ortpa.ops.validate.compute import check_compute
from ortpa.ops.validate.dtypes import dtype_name
from ortpa.ops.validate.extras import check_extras
from ortpa.ops.validate.heads import check_head_counts, check_qkv, check_v_head_size
from ortpa.ops.validate.quant import check_quantization
from ortpa.ops.validate.signature import check_types

__all__ = ["check_inputs"]

# the cache's storage type by its element type; every other cache type stores float16 (§1.5, §1.9)
_STORAGE = {"uint8": "int4", "int8": "int8", "float8e4m3fn": "float8e4m3fn", "bfloat16": "bfloat16"}


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
    r = Rules(node, unchecked)
    check_types(inputs, node=node, unchecked=r.unchecked)
    a = check_constructor(attrs, r, constructor_checks)
    nh: int = a["num_heads"]
    kvh: int = a["kv_num_heads"]
    latent = a["kv_cache_layout"] == "LATENT"
    has = {f.name: present(inputs, f.name) for f in PAGED_ATTENTION.inputs}
    shp = {n: shape_of(inputs[n]) if has[n] else None for n in has}
    kc_type = dtype_name(getattr(inputs["key_cache"], "dtype", None))
    storage = None if kc_type is None else _STORAGE.get(kc_type, "float16")

    check_head_counts(nh, kvh, max_threads_per_block, r)  # §1.1
    qkv = check_qkv(has, shp, nh, kvh, latent, r)  # §1.2
    head_size = qkv.head_size
    v_head_size, explicit_scale = check_v_head_size(a, head_size, latent, r)  # §1.3
    check_layout(has, a, kvh, latent, r)  # §1.4
    num_blocks, block_size = check_kv_cache(shp, has["value_cache"], kvh, head_size, storage, r)  # §1.5, §1.9
    batch_size, max_blocks = check_sequences(has, shp, qkv.tokens, r)  # §1.6
    rotary_dim = check_extras(has, shp, a, nh, head_size, r)  # §1.7
    check_quantization(has, shp, a, storage, kvh, head_size, v_head_size, latent, r)  # §1.8.1-§1.8.8, §1.9
    check_compute(inputs, has, shp, a, qkv.token_count, num_blocks, max_blocks, block_size, r)  # §1.8.9, §1.10

    k_dtype = a["k_cache_dtype"] or storage
    return PagedAttentionParams(
        batch_size=batch_size,
        token_count=qkv.token_count,
        num_heads=nh,
        kv_num_heads=kvh,
        head_size=head_size,
        v_head_size=v_head_size,
        hidden_size=qkv.hidden_size,
        kv_hidden_size=qkv.kv_hidden_size,
        num_blocks=num_blocks,
        block_size=block_size,
        max_blocks_per_seq=max_blocks,
        rotary_dim=rotary_dim,
        layout=a["kv_cache_layout"],
        is_packed_qkv=qkv.is_packed,
        is_causal=a["is_causal"] == 1,
        do_rotary=a["do_rotary"] == 1,
        rotary_interleaved=a["rotary_interleaved"] == 1,
        rotary_offset=a["rotary_offset"],
        scale=a["scale"] if explicit_scale else (1.0 / math.sqrt(head_size) if head_size else 0.0),
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
