"""Recogniser: ``com.microsoft::GroupQueryAttention`` (onnxruntime-genai builder fp32 / int4, ORT-fused exports).

One GQA node per layer reads the layer's ``past_key_values.{i}.key`` / ``.value`` as its inputs 3 / 4 and writes
``present.{i}.key`` / ``.value``. Its query is the packed QKV projection (key and value inputs empty) or separate
q / k / v (Qwen3: after a per-head ``SimplifiedLayerNormalization``, which stays in the graph, as it runs before
RoPE in the source too). With ``do_rotary=1`` the op applies RoPE itself from ``cos_cache`` / ``sin_cache``
tables indexed by position: those tables become PagedAttention's own rotary inputs (``do_rotary=1``, the same
``rotary_interleaved``), since both ops take the position of a token as its past length plus its index. Tables
chosen at run time by LongRoPE's ``If`` on the total length become a per-sequence choice with RoPE applied in the
graph (:mod:`ortpa.rewriter.per_sequence.rope_choice`).

What the GQA node computes from ``attention_mask`` (``seqlens_k``, ``total_sequence_length``) is replaced by the
paged inputs and becomes dead. ``local_window_size`` carries over as it is: in ONNX Runtime's GQA (CPU kernel,
checked against it by the tests) as in PagedAttention, a window W lets a query see W keys, its own included.
Attention sinks (``head_sink``, gpt-oss) become PagedAttention's ``head_sink``
input, and ``smooth_softmax=1`` a ``head_sink`` of zeros (the same softmax). Features without a PagedAttention
equivalent here (``attention_bias``, an explicit ``position_ids`` input, ``qk_output``) refuse the layer with the
reason.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import attr_value, const_array, static_width
from ortpa.rewriter.layer import AttentionLayer, SourceRotary
from ortpa.rewriter.per_sequence.rope_choice import ChosenRotary, chosen_rotary
from ortpa.rewriter.recognisers._match import MatchFail, cache_inputs, consumer_ops, need

__all__ = ["OP_TYPE", "SinkAttentionLayer", "recognise_gqa"]

OP_TYPE = "GroupQueryAttention"


def _node(past_k: ir.Value) -> ir.Node:
    for node in past_k.consumers():
        if node.op_type == OP_TYPE and node.domain == "com.microsoft":
            return node
    raise MatchFail(f"the key cache is not read by com.microsoft::{OP_TYPE} (read by {consumer_ops(past_k)})", past_k)


def _table_choice(value: ir.Value) -> str:
    node = value.producer()
    return f"{node.op_type} {node.name}" if node is not None else "a graph input"


@dataclass
class SinkAttentionLayer(AttentionLayer):
    """A GQA layer with its attention sinks: ``head_sink`` ``[num_heads]`` logits that join each softmax's
    denominator (PagedAttention's ``head_sink`` input; None: no sink)."""

    head_sink: np.ndarray | None = None


def _head_sink(node: ir.Node, sink: ir.Value | None, heads: int) -> np.ndarray | None:
    """GroupQueryAttention's sinks as PagedAttention's ``head_sink``, or None.

    Both ops divide by ``e^{s_h - m} + sum_j e^{x_j - m}`` with ``m = max(s_h, max_j x_j)`` (ONNX Runtime's GQA
    "smooth softmax"); ``smooth_softmax=1`` without a ``head_sink`` input is that with ``s_h = 0`` for every head.
    """
    smooth = int(attr_value(node, "smooth_softmax", 0))
    if sink is None:
        return np.zeros(heads, np.float32) if smooth else None
    values = const_array(sink)
    need(values is not None, f"head_sink {sink.name!r} is computed at run time, not a constant", sink)
    assert values is not None
    need(
        values.shape == (heads,),
        f"head_sink has shape {tuple(values.shape)}, expected ({heads},) (one sink logit per query head)",
        sink,
    )
    return values.astype(np.float32)


def recognise_gqa(graph: ir.Graph, layer: int) -> AttentionLayer:
    """Describe layer ``layer``'s GroupQueryAttention; a :class:`MatchFail` with the reason when it cannot."""
    past_k, past_v = cache_inputs(graph, layer)
    node = _node(past_k)
    ins = list(node.inputs) + [None] * (12 - len(node.inputs))
    need(ins[3] is past_k and ins[4] is past_v, "the caches are not the op's past_key / past_value inputs", node)
    h, kvh = int(attr_value(node, "num_heads", 0)), int(attr_value(node, "kv_num_heads", 0))
    need(h > 0 and kvh > 0 and h % kvh == 0, f"num_heads {h} / kv_num_heads {kvh} are not GQA heads", node)
    need(
        int(attr_value(node, "qk_output", 0)) == 0,
        f"qk_output={attr_value(node, 'qk_output', 0)} has no PagedAttention form",
        node,
    )
    for index, what in ((9, "position_ids"), (10, "attention_bias")):
        need(ins[index] is None, f"input {what} is set: not converted (the builder's models leave it empty)", node)
    sink = _head_sink(node, ins[11], h)
    if len(node.outputs) > 3:
        need(not node.outputs[3].uses(), "output_qk is used", node)
    query, key, value = ins[0], ins[1], ins[2]
    assert query is not None
    packed = key is None and value is None
    need(packed or (key is not None and value is not None), "only one of key / value is given", node)
    width = static_width(query)
    need(width is not None, f"query width is unknown ({query.shape}) and no projection states it", query)
    assert width is not None
    heads = h + 2 * kvh if packed else h
    need(width % heads == 0, f"query width {width} is not a multiple of {heads} heads", query)
    d = width // heads
    if not packed:
        for what, v in (("key", key), ("value", value)):
            w = static_width(v)
            need(w in (None, kvh * d), f"{what} width {w}, expected {kvh} KV heads x {d}", v)
    need(d % 8 == 0, f"head size {d} is not a multiple of 8 (PagedAttention)", query)
    present_k, present_v = node.outputs[1], node.outputs[2]
    outputs = set(graph.outputs)
    need(
        present_k in outputs and present_v in outputs,
        "the op's present_key / present_value are not graph outputs",
        node,
    )

    rotary = None
    if int(attr_value(node, "do_rotary", 0)):
        cos, sin = ins[7], ins[8]
        need(cos is not None and sin is not None, "do_rotary=1 without cos_cache / sin_cache", node)
        assert cos is not None and sin is not None
        cos_a, sin_a = const_array(cos), const_array(sin)
        interleaved = int(attr_value(node, "rotary_interleaved", 0))
        if cos_a is None or sin_a is None:
            # LongRoPE (genai Phi-3.x / Phi-4-mini): one If picks a table from the total length; made per sequence
            # with RoPE applied in the graph (ortpa.rewriter.per_sequence.rope_choice)
            chosen = chosen_rotary(cos, sin, ins[6], interleaved)
            need(
                not isinstance(chosen, str),
                f"cos_cache / sin_cache are computed at run time ({_table_choice(cos)}) and not as a choice ortpa "
                f"can make per sequence: {chosen}",
                cos,
            )
            assert isinstance(chosen, ChosenRotary)
            half = chosen.then_cos.shape[1]
            need(
                2 * half <= d,
                f"cos/sin tables of width {half}: rotary_dim {2 * half} exceeds the head size {d}",
                cos,
            )
            rotary = chosen
        else:
            half = cos_a.shape[1] if cos_a.ndim == 2 else -1
            need(
                cos_a.shape == sin_a.shape and half % 8 == 0 and half <= (d // 16) * 8,
                f"cos/sin caches {cos_a.shape}/{sin_a.shape}: PagedAttention needs [positions, rotary_dim/2] with "
                f"rotary_dim/2 a multiple of 8 and <= {(d // 16) * 8} (head size {d})",
                cos,
            )
            rotary = SourceRotary(cos, sin, interleaved)
    scale = float(attr_value(node, "scale", 0.0)) or 1.0 / math.sqrt(d)
    window = int(attr_value(node, "local_window_size", -1))
    return SinkAttentionLayer(
        head_sink=sink,
        layer=layer,
        num_heads=h,
        kv_num_heads=kvh,
        head_size=d,
        scale=scale,
        softcap=float(attr_value(node, "softcap", 0.0)),
        local_window_size=window if window > 0 else -1,
        query=query,
        key=key,
        value=value,
        attn_out=node.outputs[0],
        notes=[
            f"{OP_TYPE} ({'packed' if packed else 'separate'} QKV, do_rotary={int(rotary is not None)}"
            + (", attention sinks" if sink is not None else "")
            + ")"
        ],
        layout="bsd",
        packed_qkv=packed,
        rotary=rotary,
        source=OP_TYPE,
    )
