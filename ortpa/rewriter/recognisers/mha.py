"""Recogniser: ``com.microsoft::MultiHeadAttention`` with past / present KV (onnxruntime-genai builder fp16).

The builder's fp16 CPU models rotate q and k with ``com.microsoft::RotaryEmbedding`` (fed by ``position_ids``)
and attend with one MultiHeadAttention per layer: inputs ``query`` / ``key`` / ``value`` ``[B,S,H*D]``, an
``attention_bias`` built from ``attention_mask``, ``past_key`` / ``past_value`` (the layer's
``past_key_values.{i}.*``), outputs ``present_key`` / ``present_value``. The RotaryEmbedding nodes stay in the
graph (``position_ids`` becomes the packed positions, so each token is rotated at its own position) and the op
gets already-rotated q / k (``do_rotary=0``). The mask machinery becomes dead: what it encoded, causal
attention over the sequence's own past and new tokens, is what PagedAttention does. A mask that is not derived
from the model's ``attention_mask`` input (a window, a bias) refuses the layer.
"""

from __future__ import annotations

import math
from collections import deque

import onnx_ir as ir

from ortpa.rewriter._graph import static_dim, static_width
from ortpa.rewriter._match import MatchFail, cache_inputs, consumer_ops, need
from ortpa.rewriter.attention_match import AttentionLayer

__all__ = ["OP_TYPE", "recognise_mha"]

OP_TYPE = "MultiHeadAttention"


def _attr(node: ir.Node, name: str, default):
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


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


def recognise_mha(graph: ir.Graph, layer: int) -> AttentionLayer:
    """Describe layer ``layer``'s MultiHeadAttention; a :class:`MatchFail` with the reason when it cannot."""
    past_k, past_v = cache_inputs(graph, layer)
    node = next((n for n in past_k.consumers() if n.op_type == OP_TYPE and n.domain == "com.microsoft"), None)
    if node is None:
        raise MatchFail(f"the key cache is not read by com.microsoft::{OP_TYPE} ({consumer_ops(past_k)})", past_k)
    ins = list(node.inputs) + [None] * (10 - len(node.inputs))
    need(ins[6] is past_k and ins[7] is past_v, "the caches are not the op's past_key / past_value inputs", node)
    h = int(_attr(node, "num_heads", 0))
    need(h > 0, "num_heads is not set", node)
    for index, what in ((3, "bias"), (8, "past_sequence_length"), (9, "cache_indirection")):
        need(ins[index] is None, f"input {what} is set: not converted", node)
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
    need(
        all(x.shape is None or len(x.shape) == 3 for x in (query, key, value)),
        f"q / k / v are not [batch, seq, hidden]: {query.shape}, {key.shape}, {value.shape}",
        node,
    )
    width = static_width(query)
    need(width is not None and width % h == 0, f"query width {width} is not {h} heads x head size", query)
    assert width is not None
    d = width // h
    kvh = static_dim(past_k, 1)
    need(kvh is not None, f"key cache heads are not static: {past_k.shape}", past_k)
    assert kvh is not None
    need(kvh == h, f"MultiHeadAttention with {h} heads over a {kvh}-head cache", past_k)
    for what, v in (("key", key), ("value", value)):
        w = static_width(v)
        need(w in (None, kvh * d), f"{what} width {w}, expected {kvh} heads x {d}", v)
    need(d % 8 == 0, f"head size {d} is not a multiple of 8 (PagedAttention)", query)
    outputs = set(graph.outputs)
    need(
        len(node.outputs) >= 3 and node.outputs[1] in outputs and node.outputs[2] in outputs,
        "the op's present_key / present_value are not graph outputs",
        node,
    )
    if len(node.outputs) > 3:
        need(not node.outputs[3].uses(), "the op's qk output is used", node)
    return AttentionLayer(
        layer=layer,
        num_heads=h,
        kv_num_heads=kvh,
        head_size=d,
        scale=float(_attr(node, "scale", 0.0)) or 1.0 / math.sqrt(d),
        softcap=0.0,
        local_window_size=-1,
        query=query,
        key=key,
        value=value,
        attn_out=node.outputs[0],
        notes=[f"{OP_TYPE} (mask from attention_mask)"],
        layout="bsd",
        source=OP_TYPE,
    )
