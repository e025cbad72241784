"""Parameters of one PagedAttention call, as derived by :func:`ortpa.ops.validate.check_inputs`.

Dimension fields are ``int`` for concrete inputs; when a model is validated from declared (possibly
symbolic) shapes, a dimension that is not known is ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PagedAttentionParams"]


@dataclass(frozen=True)
class PagedAttentionParams:
    # sizes
    batch_size: int | None
    token_count: int | None
    num_heads: int
    kv_num_heads: int
    head_size: int | None
    v_head_size: int | None
    hidden_size: int | None  # query hidden (num_heads * head_size, or the raw q dim1 in SEPARATE)
    kv_hidden_size: int | None
    num_blocks: int | None
    block_size: int | None
    max_blocks_per_seq: int | None
    rotary_dim: int | None  # 2 * cos_cache.shape[1]; 0 without rotary caches; None if cos dim 1 is unknown
    # modes
    layout: str  # "SEPARATE" | "LATENT"
    is_packed_qkv: bool
    is_causal: bool
    do_rotary: bool
    rotary_interleaved: bool
    rotary_offset: int
    scale: float  # effective scale: the attribute if non-zero, else 1/sqrt(head_size) (0.0 if head unknown)
    has_explicit_scale: bool
    softcap: float
    local_window_size: int
    qk_norm_epsilon: float
    use_qk_norm: bool
    has_head_sink: bool
    has_slot_mapping: bool
    has_attention_metadata: bool
    # caches
    cache_storage_dtype: str | None  # "float16" | "bfloat16" | "int8" | "float8e4m3fn" | "int4"; None: unknown type
    k_quant_type: str  # "NONE" | "PER_TENSOR" | "PER_CHANNEL"
    v_quant_type: str
    k_cache_dtype: str  # logical type after resolving '' against the tensor
    v_cache_dtype: str  # LATENT: the key's (the value elements are the key elements)
    # the activation type T ("float16" | "bfloat16"); None when not declared. Defaulted: added later.
    activation_dtype: str | None = None

    @property
    def is_latent(self) -> bool:
        return self.layout == "LATENT"

    @property
    def is_quantized_cache(self) -> bool:
        return self.cache_storage_dtype in ("int8", "float8e4m3fn", "int4", "float4e2m1")

    @property
    def output_width(self) -> int | None:
        return None if self.v_head_size is None else self.num_heads * self.v_head_size
