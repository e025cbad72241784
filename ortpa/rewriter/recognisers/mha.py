"""Recogniser: ``com.microsoft::MultiHeadAttention`` with past / present KV (onnxruntime-genai builder fp16).

The builder's fp16 CPU models rotate q and k with ``com.microsoft::RotaryEmbedding`` (fed by ``position_ids``),
append the new keys / values to the layer's ``past_key_values.{i}.*`` with a ``Concat`` (whose output is
``present.{i}.*``), repeat the KV heads (``Unsqueeze / Expand / Reshape``) and attend with one
MultiHeadAttention per layer: ``query`` ``[B,S,H*D]``, ``key`` / ``value`` ``[B,T,H*D]`` (the whole repeated
cache), and an ``attention_bias`` built from ``attention_mask``. The RotaryEmbedding nodes stay in the
graph (``position_ids`` becomes the packed positions, so each token is rotated at its own position) and the op
gets already-rotated q / k (``do_rotary=0``). The mask machinery becomes dead: what it encoded, causal
attention over the sequence's own past and new tokens, is what PagedAttention does. A mask that is not derived
from the model's ``attention_mask`` input (a window, a bias) refuses the layer.
"""

from __future__ import annotations

import math
from collections import deque

import onnx_ir as ir

from ortpa.rewriter._graph import attr_value, ints_attr, producer_op, static_dim, static_width
from ortpa.rewriter.layer import AttentionLayer
from ortpa.rewriter.recognisers._match import MatchFail, cache_concat, cache_inputs, consumer_ops, need, reaches

__all__ = ["OP_TYPE", "forward_op", "recognise_mha"]

OP_TYPE = "MultiHeadAttention"


def _derives_from_attention_mask(value: ir.Value, max_nodes: int = 200) -> bool:
    """Every graph input the mask depends on is ``attention_mask`` / ``input_ids`` / ``position_ids`` / a cache
    (shapes only), i.e. it encodes padding and causality, nothing the paged op would drop silently."""
    seen: set[int] = set()
    queue = deque([value])
    found_mask = False
    while queue and len(seen) < max_nodes:
        v = queue.popleft()
        node = v.producer()
        if node is None:
            if v.is_graph_input():
                name = v.name or ""
                if name == "attention_mask":
                    found_mask = True
                elif not (name in ("input_ids", "position_ids") or name.startswith("past_key_values.")):
                    return False
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        queue.extend(x for x in node.inputs if x is not None)
    return found_mask


def forward_op(start: ir.Value, op_type: str, max_nodes: int = 80) -> ir.Node | None:
    """The first ``com.microsoft::op_type`` node reached forward from ``start`` (through the repeat_kv nodes)."""
    seen: set[int] = set()
    queue = deque([start])
    while queue and len(seen) < max_nodes:
        for node in queue.popleft().consumers():
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == op_type and node.domain == "com.microsoft":
                return node
            queue.extend(node.outputs)
    return None


def _bsd(value: ir.Value, what: str) -> ir.Value:
    """``[B,KVH,S,D]`` new keys / values as cached -> the ``[B,S,KVH*D]`` tensor they were reshaped from."""
    node = producer_op(value, "Transpose")
    need(
        node is not None and ints_attr(node, "perm") == [0, 2, 1, 3],
        f"new {what} is not Transpose(0,2,1,3)",
        value,
    )
    assert node is not None
    reshape = producer_op(node.inputs[0], "Reshape")
    need(reshape is not None, f"new {what} is not a Reshape of [batch, seq, heads * head]", node.inputs[0])
    assert reshape is not None
    return reshape.inputs[0]


def recognise_mha(graph: ir.Graph, layer: int) -> AttentionLayer:
    """Describe layer ``layer``'s MultiHeadAttention; a :class:`MatchFail` with the reason when it cannot."""
    past_k, past_v = cache_inputs(graph, layer)
    present_k, k_new = cache_concat(past_k)
    present_v, v_new = cache_concat(past_v)
    node = forward_op(present_k, OP_TYPE)
    if node is None:
        raise MatchFail(f"no com.microsoft::{OP_TYPE} reads the key cache ({consumer_ops(present_k)})", present_k)
    ins = list(node.inputs) + [None] * (10 - len(node.inputs))
    h = int(attr_value(node, "num_heads", 0))
    need(h > 0, "num_heads is not set", node)
    for index, what in ((3, "bias"), (6, "past_key"), (7, "past_value"), (8, "past_sequence_length")):
        need(ins[index] is None, f"input {what} is set: not converted (the cache is concatenated before the op)", node)
    need(ins[9] is None, "input cache_indirection is set: not converted", node)
    for index in (4, 5):
        mask = ins[index]
        if mask is not None:
            need(
                _derives_from_attention_mask(mask),
                "the attention mask depends on more than attention_mask (a window or a bias): not converted",
                mask,
            )
    query, key, value = ins[0], ins[1], ins[2]
    need(query is not None and key is not None and value is not None, "packed or missing q / k / v", node)
    assert query is not None and key is not None and value is not None
    need(reaches(key, present_k, 80), "the op's key does not come from the key cache", key)
    need(reaches(value, present_v, 80), "the op's value does not come from the value cache", value)
    width = static_width(query)
    need(width is not None and width % h == 0, f"query width {width} is not {h} heads x head size", query)
    assert width is not None
    d = width // h
    kvh = static_dim(past_k, 1)
    need(kvh is not None and h % kvh == 0, f"key cache heads {kvh} do not divide {h} query heads", past_k)
    assert kvh is not None
    k_bsd, v_bsd = _bsd(k_new, "key"), _bsd(v_new, "value")
    for what, v in (("key", k_bsd), ("value", v_bsd)):
        w = static_width(v)
        need(w in (None, kvh * d), f"new {what} width {w}, expected {kvh} heads x {d}", v)
    need(d % 8 == 0, f"head size {d} is not a multiple of 8 (PagedAttention)", query)
    if len(node.outputs) > 1:
        need(not any(o.uses() for o in node.outputs[1:]), "the op's present / qk outputs are used", node)
    return AttentionLayer(
        layer=layer,
        num_heads=h,
        kv_num_heads=kvh,
        head_size=d,
        scale=float(attr_value(node, "scale", 0.0)) or 1.0 / math.sqrt(d),
        softcap=0.0,
        local_window_size=-1,
        query=query,
        key=k_bsd,
        value=v_bsd,
        attn_out=node.outputs[0],
        notes=[f"{OP_TYPE} (cache Concat + repeat_kv before the op; mask from attention_mask)"],
        layout="bsd",
        source=OP_TYPE,
    )
