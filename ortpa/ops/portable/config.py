"""What a portable function is specialised on: a layer's :class:`PortableConfig`, a step plan's :class:`PlanConfig`,
and the plan's inputs and outputs that connect the two.

Types and names only, so that the lowering, the plan tracer and the layer tracer all import them and none of
them another for a type.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import onnx_ir as ir

__all__ = [
    "DEFAULT_OPSET",
    "INDEX_TYPE",
    "ORT_DOMAIN",
    "PLAN_INPUTS",
    "PLAN_OUTPUTS",
    "PLAN_OUTPUT_TYPES",
    "PlanConfig",
    "PortableConfig",
]

DEFAULT_OPSET = 21  # the default-domain opset of functions built outside a model (one-node models, tools)
ORT_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (MultiHeadAttention), version 1 in every release

# What the plan function computes once per step for every layer that shares its index inputs; the layer
# function takes them as its trailing inputs. ``p_*``: the prefilling group, ``d_*``: the decoding group.
PLAN_OUTPUTS = (
    "pos",  # [T] position of every token (RoPE)
    "write_rows",  # [n] tokens whose K/V are written (compacted, de-duplicated)
    "write_index",  # [n, 2] (block, offset) of each written row
    "any_prefill",  # bool scalar: some prefilling sequence has a key (else the layers skip the group)
    "any_decode",  # bool scalar: some decoding sequence attends a key (else the layers skip the group)
    "out_row",  # [T] each token's row in Concat(decode output, prefill output, one zero row)
    "d_query",  # [D] the decoding sequences' tokens
    "d_row",  # [D, kvh, kv_d] cache rows (of the cache viewed as [slots * kvh, H]); one not live reads an attended one
    "d_allowed",  # [D, 1, 1, kv_d] keys the query attends (live, inside the local window)
    "d_bias",  # [D, 1, 1, kv_d] float32: 0 where d_allowed, else -inf (com.microsoft::MultiHeadAttention's bias)
    "p_query",  # [P, max_q] the prefilling sequences' tokens (padding rows clamped onto real tokens)
    "p_row",  # [P, kvh, kv_p]
    "p_row_ok",  # [P, 1, kv_p, 1]
    "p_allowed",  # [P, 1, kv_p, 1, max_q] causal / window / live mask
    "p_rows_ok",  # bool scalar
    "p_count",  # [1] P
    "p_max_q",  # [1] max_q
    "p_max_kv",  # [1] kv_p
)
# inputs of the plan function, in this order; slot_mapping only when the node passes it
PLAN_INPUTS = ("query", "key_cache", "cumulative_sequence_length", "past_seqlens", "block_table", "slot_mapping")
# Element types (ONNX TensorProto codes) of the plan's outputs and of the op's index inputs (its type S), declared
# on the functions' formal inputs: the tracer then knows every value's type, so a Python constant becomes a
# constant of that type, not a CastLike the function's reader must resolve (OpenVINO's reader takes such nodes
# apart into subgraphs of their own). Activations and caches are typed per configuration (the layer's tracer).
_BOOL_OUTPUTS = frozenset({"any_prefill", "any_decode", "d_allowed", "p_row_ok", "p_allowed", "p_rows_ok"})
PLAN_OUTPUT_TYPES: dict[str, ir.DataType] = {
    name: ir.DataType.BOOL if name in _BOOL_OUTPUTS else ir.DataType.FLOAT if name == "d_bias" else ir.DataType.INT64
    for name in PLAN_OUTPUTS
}
INDEX_TYPE = ir.DataType.INT32  # cumulative_sequence_length, past_seqlens, block_table, slot_mapping (the op's S)


@dataclass(frozen=True)
class PortableConfig:
    """Everything the graph is specialised on; equal configs share one function."""

    present_inputs: tuple[str, ...]  # schema names of the inputs the node passes, in schema order
    present_outputs: tuple[str, ...]  # "output" plus the cache outputs the node produces
    act_dtype: int  # ir.DataType of T (FLOAT16 / BFLOAT16)
    cache_dtype: int  # ir.DataType of the caches (T, or INT8)
    num_heads: int
    kv_num_heads: int
    head_size: int
    v_head_size: int
    query_width: int | None  # query dim 1 when declared; used to cut the SEPARATE "hidden % num_heads" quirk
    latent: bool
    packed_qkv: bool
    scale: float
    softcap: float
    local_window_size: int
    is_causal: bool
    rotary_dim: int  # 0: no RoPE
    rotary_interleaved: bool
    rotary_offset: int
    use_qk_norm: bool
    qk_norm_epsilon: float
    k_quant: str  # NONE / PER_TENSOR / PER_CHANNEL
    v_quant: str
    opset: int
    # LATENT only: each latent row is stored split in two, channels [0, H/2) in ``key_cache`` and [H/2, H) in
    # ``value_cache`` (both [NB, BS, 1, H/2]): the layout of runtimes that allocate a key and a value cache of
    # one head size per layer (onnxruntime-genai), at the LATENT memory of one row per token
    split_latent: bool = False
    # the key cache's write also stores rows the graph computed itself (two trailing inputs ``extra.index``
    # [n, 2] and ``extra.rows`` [n, kv_heads, head_size] in the cache type): a ScatterND that followed the node on
    # its key_cache_out, folded into the node's own write so that the cache is still written once, in place
    # (the expanded MLA prefill's fresh rows: :mod:`ortpa.ops.trailing_write`)
    extra_write: bool = False
    # decodes attend through ONNX Runtime's fused com.microsoft::MultiHeadAttention (see
    # ``ortpa.ops.portable.layer``); set by the lowering only where that op computes the same thing
    fused_decode: bool = False
    # cos_cache / sin_cache are initializers of a size worth folding: the layer builds its float32 table of every
    # row from them alone, which ONNX Runtime folds into a constant when it opens the session
    rope_table_folded: bool = False
    # no ``If``: both groups are computed at every step, each padded to at least one member (a dummy sequence
    # with no key when the group is empty) and one key, so that no kernel sees an empty batch; for compilers
    # that refuse ``If`` bodies (OpenVINO's CPU plug-in), at the cost of the skipped group's kernels
    if_free: bool = False

    @property
    def opset_imports(self) -> dict[str, int]:
        """The function's opsets: the model's default-domain version, and ONNX Runtime's for the fused ops."""
        return {"": self.opset, ORT_DOMAIN: 1} if self.fused_decode else {"": self.opset}

    @property
    def group(self) -> int:
        return self.num_heads // self.kv_num_heads

    def function_name(self) -> str:
        """A name that differs for different configs and is the same in every process (not ``hash``)."""
        return f"PagedAttention_{hashlib.sha1(repr(self).encode()).hexdigest()[:10]}"


@dataclass(frozen=True)
class PlanConfig:
    """What the per-step index work depends on besides its inputs; layers with equal plans and the same index
    inputs (and token / cache dimensions) share one plan call."""

    kv_num_heads: int
    local_window_size: int
    is_causal: bool
    slot_mapping: bool
    opset: int
    if_free: bool = False  # see PortableConfig.if_free

    @classmethod
    def of(cls, cfg: PortableConfig) -> PlanConfig:
        return cls(
            kv_num_heads=cfg.kv_num_heads,
            local_window_size=cfg.local_window_size,
            is_causal=cfg.is_causal,
            slot_mapping="slot_mapping" in cfg.present_inputs,
            opset=cfg.opset,
            if_free=cfg.if_free,
        )

    @property
    def inputs(self) -> tuple[str, ...]:
        return PLAN_INPUTS if self.slot_mapping else PLAN_INPUTS[:-1]

    def function_name(self) -> str:
        return f"PagedAttentionPlan_{hashlib.sha1(repr(self).encode()).hexdigest()[:10]}"
