"""Dense MHA / GQA attention -> ``com.microsoft::PagedAttention`` with ``kv_cache_layout="SEPARATE"``.

What a transformers-5.x export of a Llama / Qwen / Mistral / Gemma-2 attention looks like (per layer ``i``)::

    q = x @ Wq [+ bq] -> Reshape[B,S,H,D] [-> RMSNorm over D (Qwen3 q_norm)] -> Transpose(0,2,1,3)   [B,H,S,D]
    k = x @ Wk [+ bk] -> Reshape[B,S,KVH,D] [-> RMSNorm (k_norm)] -> Transpose                      [B,KVH,S,D]
    v = x @ Wv [+ bv] -> Reshape -> Transpose                                                         [B,KVH,S,D]
    RoPE  : q, k = q*cos + rotate_half(q)*sin, ...      (cos/sin computed from position_ids)
    cache : present.i.key = Concat(past_key_values.i.key, k, axis=-2), present.i.value likewise
    GQA   : repeat_kv = Unsqueeze(2) -> Expand -> Reshape[B,H,T,D]   (absent when KVH == H)
    attn  : Softmax(softcap(scale * q @ k^T) + mask) @ v    (eager / SDPA: MatMul+Softmax, SDPA splits the
            scale over q and k^T; opset 23: one ONNX Attention) -> [B,H,S,D] -> Transpose -> Reshape -> o_proj

One PagedAttention SEPARATE node replaces the cache concat, repeat_kv, the attention core and the mask:
query ``[T, H*D]``, key / value ``[T, KVH*D]`` (tokens packed by :mod:`ortpa.rewriter.paged_io`), caches
``[num_blocks, block_size, KVH, D]``. The mask machinery becomes dead; what it encoded is carried over as
attributes: causality (the op is causal), and a sliding window (``kv > q - W`` in the mask) as
``local_window_size = W`` (both count the current token). The softmax scale is written only when it differs
from ``1/sqrt(D)``; Gemma-2's ``softcap * tanh(scores / softcap)`` becomes ``softcap``.

RoPE: by default (``rope_in_op=False``) the model's own RoPE (and Qwen3's q/k norm before it) stays in the
graph and the op gets already-rotated q/k (``do_rotary=0``). That is the robust choice: it is exact for every
RoPE variant an export may contain (Llama-3 / YaRN / LongRoPE scaling, attention factors, partial rotary,
interleaving), it needs no cos/sin tables and no head-size constraint, and the cached K is bit-for-bit what the
dense model caches. ``rope_in_op=True`` moves a recognised full-width rotate_half RoPE into the op
(``do_rotary=1`` + cos/sin caches evaluated from the graph's own tables, head size a multiple of 16) and with it
a recognised q/k RMSNorm (``q_norm_weight``/``k_norm_weight``, ``qk_norm_epsilon``), which the op applies before
RoPE as the model does; what is not recognised is reported, not approximated.

Matching is structural and anchored on the cache I/O names, like :mod:`ortpa.rewriter.mla`; the graph is never
modified by matching (:mod:`ortpa.rewriter.recognisers.decomposed`).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import Builder
from ortpa.rewriter.layer import AttentionLayer, PagedAttentionInputs
from ortpa.rewriter.packed import PagedIO
from ortpa.rewriter.per_sequence import rope_choice

__all__ = ["op_constant", "rewrite_attention_layer", "rope_in_op_problems"]


def rope_in_op_problems(m: AttentionLayer) -> list[str]:
    """Why RoPE (and q/k norm) of ``m`` cannot move into the op; empty when it can."""
    problems = []
    if not m.rope_recognised:
        problems.append("RoPE not recognised as full-width rotate_half (x*cos + rotate_half(x)*sin) on q and k")
    if m.head_size % 16:
        problems.append(f"head size {m.head_size} is not a multiple of 16 (do_rotary=1)")
    if (m.q_norm is None) != (m.k_norm is None):
        problems.append("only one of q / k has an RMSNorm before RoPE")
    if m.q_norm is not None and m.k_norm is not None and m.q_norm.epsilon != m.k_norm.epsilon:
        problems.append(f"q / k norm epsilons differ ({m.q_norm.epsilon} vs {m.k_norm.epsilon}): the op has one")
    return problems


def _packed(b: Builder, value: ir.Value, heads: int, d: int, *, bshd: bool = False) -> ir.Value:
    """[1,heads,T,D] (or [1,T,heads,D] when ``bshd``, or [1,T,heads*D]) -> [T, heads*D]."""
    if not bshd:
        value = b.op("Transpose", [value], {"perm": [0, 2, 1, 3]})
    return b.op("Reshape", [value, b.ints([-1, heads * d])])


def _source_rotary_tables(b: Builder, m: AttentionLayer, op_dtype: ir.DataType) -> tuple[ir.Value, ir.Value]:
    """The source op's cos / sin tables as initializers of the op's type (PagedAttention takes T for them)."""
    assert m.rotary is not None
    out = []
    for what, table in (("cos_cache", m.rotary.cos), ("sin_cache", m.rotary.sin)):
        array = table.const_value.numpy() if table.const_value is not None else None
        if array is None:
            raise ValueError(f"layer {m.layer}: the {what} of the source op is not a constant ({table.name})")
        out.append(op_constant(b, array, what, op_dtype))
    return out[0], out[1]


def op_constant(b: Builder, array: np.ndarray, hint: str, op_dtype: ir.DataType) -> ir.Value:
    """A constant input of the op (RoPE tables, q/k-norm weights, sinks) in the op's type T: stored in the
    source's own precision and cast in the graph (ONNX Runtime folds the Cast at session start) where that
    precision is wider than T, so that verification's float32 twin (:mod:`ortpa.parity.twin`) reads the exact
    values by retargeting the Cast."""
    source = np.asarray(array)
    if source.dtype == op_dtype.numpy() or source.dtype.kind != "f" or source.dtype.itemsize <= 2:
        return b.initializer(source.astype(op_dtype.numpy()), hint)
    value = b.op("Cast", [b.initializer(source, hint)], {"to": op_dtype}, hint=f"{hint}_to_T")
    value.shape, value.type = ir.Shape(source.shape), ir.TensorType(op_dtype)
    return value


def rewrite_attention_layer(
    graph: ir.Graph,
    m: AttentionLayer,
    key_cache: ir.Value,
    value_cache: ir.Value,
    paged: PagedAttentionInputs,
    *,
    rope_in_op: bool = False,
    op_dtype: ir.DataType = ir.DataType.FLOAT16,
    packed_io: PagedIO | None = None,
) -> tuple[ir.Value, ir.Value]:
    """Replace the attention of ``m`` by PagedAttention SEPARATE; return ``(key_cache_out, value_cache_out)``.

    When the model computes in another float type than ``op_dtype`` q/k/v are cast to it and the output back.
    The dense nodes become dead; the caller's dead-code pass removes them. A rotary whose tables the source
    chooses at run time (:class:`~ortpa.rewriter.per_sequence.rope_choice.ChosenRotary`) is applied in the graph, per
    sequence, before the op (``do_rotary=0``); that needs ``packed_io``.
    """
    chosen = m.rotary if isinstance(m.rotary, rope_choice.ChosenRotary) else None
    if chosen is not None and packed_io is None:
        raise ValueError(f"layer {m.layer}: a run-time RoPE table choice needs the packed inputs (packed_io)")
    if m.rotary is not None:
        rope_in_op = False  # the source op's own RoPE moves into the op whatever rope_in_op says
    if rope_in_op and rope_in_op_problems(m):
        raise ValueError(f"layer {m.layer}: RoPE cannot move into the op: {rope_in_op_problems(m)}")
    b = Builder(graph, f"/attention/layers.{m.layer}")
    h, kvh, d = m.num_heads, m.kv_num_heads, m.head_size
    model_dtype = m.query.dtype or ir.DataType.FLOAT
    q_norm_w = k_norm_w = None
    key: ir.Value | None
    value: ir.Value | None
    if m.layout == "bsd":  # [B,S,H*D]: the com.microsoft attention ops' layout, already what the op packs
        if m.packed_qkv:
            query, key, value = _packed(b, m.query, h + 2 * kvh, d, bshd=True), None, None
        else:
            assert m.key is not None and m.value is not None
            query, key = _packed(b, m.query, h, d, bshd=True), _packed(b, m.key, kvh, d, bshd=True)
            value = _packed(b, m.value, kvh, d, bshd=True)
    elif rope_in_op and m.q_norm is not None and m.k_norm is not None:
        query = _packed(b, m.q_norm.input, h, d, bshd=True)
        key = _packed(b, m.k_norm.input, kvh, d, bshd=True)
        q_norm_w = op_constant(b, m.q_norm.weight, "q_norm_weight", op_dtype)
        k_norm_w = op_constant(b, m.k_norm.weight, "k_norm_weight", op_dtype)
    elif rope_in_op:
        assert m.query_raw is not None and m.key_raw is not None
        query, key = _packed(b, m.query_raw, h, d), _packed(b, m.key_raw, kvh, d)
    else:
        assert m.key is not None
        query, key = _packed(b, m.query, h, d), _packed(b, m.key, kvh, d)
    if m.layout != "bsd":
        assert m.value is not None
        value = _packed(b, m.value, kvh, d)
    packed_qkv = m.packed_qkv
    if chosen is not None:
        assert packed_io is not None
        if packed_qkv:
            query, key, value = b.op("Split", [query, b.ints([h * d, kvh * d, kvh * d])], {"axis": 1}, num_outputs=3)
            packed_qkv = False
        assert key is not None
        query = rope_choice.apply(b, packed_io, chosen, query, h, d, model_dtype)
        key = rope_choice.apply(b, packed_io, chosen, key, kvh, d, model_dtype)
    if model_dtype != op_dtype:
        query, key, value = (None if x is None else b.op("Cast", [x], {"to": op_dtype}) for x in (query, key, value))
    # Static widths on the op's inputs: validators and the portable lowering read head sizes from them.
    q_width = (h + 2 * kvh) * d if packed_qkv else h * d
    for x, width in ((query, q_width), (key, kvh * d), (value, kvh * d)):
        if x is not None:
            x.shape, x.type = ir.Shape(["num_tokens", width]), ir.TensorType(op_dtype)

    attrs: dict = {"num_heads": h, "kv_num_heads": kvh, "kv_cache_layout": "SEPARATE"}
    if not math.isclose(m.scale, 1.0 / math.sqrt(d), rel_tol=1e-6):
        attrs["scale"] = float(m.scale)
    if m.softcap > 0:
        attrs["softcap"] = float(m.softcap)
    if m.local_window_size > 0:
        attrs["local_window_size"] = int(m.local_window_size)
    cos = sin = None
    if m.rotary is not None and chosen is None:
        attrs.update(do_rotary=1, rotary_interleaved=int(m.rotary.interleaved))
        cos, sin = _source_rotary_tables(b, m, op_dtype)
    elif rope_in_op:
        attrs.update(do_rotary=1, rotary_interleaved=0)
        cos, sin = paged.cos_cache, paged.sin_cache
        if q_norm_w is not None:
            assert m.q_norm is not None
            attrs["qk_norm_epsilon"] = float(m.q_norm.epsilon)
    sink = getattr(m, "head_sink", None)  # recognisers.gqa.SinkAttentionLayer: attention sinks
    head_sink = None if sink is None else op_constant(b, sink, "head_sink", op_dtype)
    inputs: list[ir.Value | None] = [
        query,
        key,
        value,
        key_cache,
        value_cache,
        paged.cumulative_sequence_length,
        paged.past_seqlens,
        paged.block_table,
        cos,
        sin,
        None,  # slot_mapping: derived from block_table
        head_sink,
        q_norm_w,
        k_norm_w,
    ]
    if paged.attention_metadata is not None:
        inputs += [None, None, paged.attention_metadata]
    while inputs[-1] is None:
        inputs.pop()
    out, key_out, value_out = b.op(
        "PagedAttention", inputs, attrs, domain="com.microsoft", num_outputs=3, hint="PagedAttention"
    )
    out.shape, out.type = ir.Shape(["num_tokens", h * d]), ir.TensorType(op_dtype)
    if model_dtype != op_dtype:
        out = b.op("Cast", [out], {"to": model_dtype})
    if m.layout == "bsd":
        o = b.op("Reshape", [out, b.ints([1, -1, h * d])], hint="attn_out")  # [1,T,H*D] as the source op
    else:
        o = b.op("Reshape", [out, b.ints([1, -1, h, d])])
        o = b.op("Transpose", [o], {"perm": [0, 2, 1, 3]}, hint="attn_out")  # [1,H,T,D] as the dense attention
    m.attn_out.replace_all_uses_with(o)
    in_op = rope_in_op or (m.rotary is not None and chosen is None)
    choice = ", RoPE table chosen per sequence" if chosen is not None else ""
    m.notes.append(f"PagedAttention SEPARATE (do_rotary={int(in_op)}){choice}")
    return key_out, value_out
