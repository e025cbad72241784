"""The layer descriptions every part of the rewriter shares: what a recogniser finds, what an emitter reads.

A recogniser (:mod:`ortpa.rewriter.recognisers`) describes each attention layer as an :class:`AttentionLayer`
(MHA / GQA) or an :class:`MlaLayer` (dense MLA), or says why not with a :class:`LayerFailure`; an emitter
(:mod:`ortpa.rewriter.attention`, :mod:`ortpa.rewriter.mla`) turns the description and the graph values of
:class:`PagedAttentionInputs` into one PagedAttention node. Types only: this module imports no other part of
the rewriter, so that no recogniser imports an emitter, and no leaf a recogniser, for a type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

__all__ = ["AttentionLayer", "LayerFailure", "MlaLayer", "PagedAttentionInputs", "QkNorm", "SourceRotary"]


@dataclass(frozen=True)
class LayerFailure:
    """Why layer ``layer`` was not converted: a readable reason and the value or node it concerns."""

    layer: int
    reason: str
    where: str

    def as_pair(self) -> tuple[str, str]:
        return (f"layer {self.layer} ({self.where})", self.reason)


@dataclass(frozen=True)
class QkNorm:
    """An RMSNorm over the head dimension of q or k (Qwen3): ``x * rsqrt(mean(x^2) + eps) * weight``."""

    input: ir.Value  # [B,S,heads,D], before the norm
    weight: np.ndarray  # [D]
    epsilon: float


@dataclass(frozen=True)
class SourceRotary:
    """RoPE the source op applies itself (``GroupQueryAttention`` ``do_rotary=1``, ``RotaryEmbedding``): its
    ``[max_positions, rotary_dim / 2]`` cos / sin tables become the PagedAttention node's own rotary inputs."""

    cos: ir.Value
    sin: ir.Value
    interleaved: int


@dataclass
class AttentionLayer:
    """One dense MHA / GQA attention layer, as every recogniser describes it (the emitter's one input).

    ``layout`` says how ``query`` / ``key`` / ``value`` / ``attn_out`` are laid out: ``"bhsd"`` ``[B,H,S,D]`` (the
    decomposed and SDPA forms) or ``"bsd"`` ``[B,S,H*D]`` (the ``com.microsoft`` attention ops). ``packed_qkv``:
    ``query`` holds q, k and v side by side (``[B,S,(H+2*KVH)*D]``) and ``key`` / ``value`` are None.
    ``rotary``: RoPE applied inside the source op to ``query`` / ``key`` (None: they are already rotated).
    """

    layer: int
    num_heads: int  # H
    kv_num_heads: int  # KVH
    head_size: int  # D
    scale: float
    softcap: float  # 0 = none
    local_window_size: int  # -1 = none; else the window including the current token
    query: ir.Value  # [B,H,S,D] as the attention reads it (rotated, scale factors stripped)
    key: ir.Value | None  # [B,KVH,S,D] new keys as cached (rotated); None when packed_qkv
    value: ir.Value | None  # [B,KVH,S,D] new values; None when packed_qkv
    attn_out: ir.Value  # [B,H,S,D]
    query_raw: ir.Value | None = None  # [B,H,S,D] before RoPE (and after q_norm), when RoPE was recognised
    key_raw: ir.Value | None = None
    q_norm: QkNorm | None = None
    k_norm: QkNorm | None = None
    notes: list[str] = field(default_factory=list)
    layout: str = "bhsd"
    packed_qkv: bool = False
    rotary: SourceRotary | None = None
    source: str = "decomposed"  # the recogniser that described the layer

    @property
    def rope_recognised(self) -> bool:
        return self.query_raw is not None and self.key_raw is not None


@dataclass
class MlaLayer:
    """One matched dense MLA attention; values refer to the graph it was matched in."""

    layer: int
    num_heads: int  # H
    qk_nope: int  # P
    qk_rope: int  # R
    v_head: int  # V
    kv_lora_rank: int  # L
    scale: float
    w_kv_b: np.ndarray  # [L, H*(P+V)], the ONNX MatMul weight (Linear.weight transposed)
    q_nope: ir.Value  # [B,H,S,P]
    q_pe: ir.Value  # roped [B,H,S,R]
    q_pe_raw: ir.Value  # before RoPE [B,H,S,R]
    latent: ir.Value  # [B,1,S,L] (or [B,S,L] where the cache held expanded heads), normalised
    k_pe: ir.Value  # roped [B,1,S,R]
    k_pe_raw: ir.Value | None  # before RoPE (last dim R)
    attn_out: ir.Value  # [B,H,S,V]
    rope_interleaved: int | None  # 1: GPT-J pairs, 0: NeoX halves, None: not recognised
    q_proj: ir.Node | None = None  # MatMul(x, Wq) producing all heads' q (fold target)
    o_proj: ir.Node | None = None  # MatMul(Reshape(Transpose(attn_out)), Wo) (fold target)
    notes: list[str] = field(default_factory=list)
    kv_b_weight: ir.Value | None = None  # kv_b_proj's weight where it is a float initializer (w_kv_b's source)
    # the weights the rewrite computed from the original's, by name: ortpa.rewriter.derived's recipes
    derived: dict[str, dict] = field(default_factory=dict)

    @property
    def head_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope


@dataclass
class PagedAttentionInputs:
    """Graph values a PagedAttention node reads besides query/key (created by :mod:`paged_io`)."""

    cumulative_sequence_length: ir.Value
    past_seqlens: ir.Value
    block_table: ir.Value
    attention_metadata: ir.Value | None = None
    cos_cache: ir.Value | None = None
    sin_cache: ir.Value | None = None
