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

The fp16 Phi (phi-2) build has no Concat: the op takes the layer's caches as its own ``past_key`` /
``past_value`` (BNSH, one KV head per query head), appends its ``key`` / ``value`` inputs (the new
``[B,S,H*D]`` tensors, which PagedAttention gets as they are) along the sequence and emits ``present.{i}.*``.
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


def _own_past(node: ir.Node, past_k: ir.Value, past_v: ir.Value) -> bool:
    """The op takes the layer's caches as its own ``past_key`` / ``past_value`` (it appends the new keys / values
    along the sequence itself and emits ``present_key`` / ``present_value``)."""
    ins = list(node.inputs) + [None] * (8 - len(node.inputs))
    if ins[6] is None and ins[7] is None:
        return False
    need(
        ins[6] is past_k and ins[7] is past_v,
        f"past_key / past_value are {getattr(ins[6], 'name', None)} / {getattr(ins[7], 'name', None)}, "
        f"expected {past_k.name} / {past_v.name}",
        node,
    )
    return True


def recognise_mha(graph: ir.Graph, layer: int) -> AttentionLayer:
    """Describe layer ``layer``'s MultiHeadAttention; a :class:`MatchFail` with the reason when it cannot."""
    past_k, past_v = cache_inputs(graph, layer)
    direct = next((n for n in past_k.consumers() if n.op_type == OP_TYPE and n.domain == "com.microsoft"), None)
    if direct is not None and _own_past(direct, past_k, past_v):
        return _recognise(direct, layer, past_k, None, None)
    present_k, k_new = cache_concat(past_k)
    present_v, v_new = cache_concat(past_v)
    node = forward_op(present_k, OP_TYPE)
    if node is None:
        raise MatchFail(f"no com.microsoft::{OP_TYPE} reads the key cache ({consumer_ops(present_k)})", present_k)
    return _recognise(node, layer, past_k, (present_k, k_new), (present_v, v_new))


def _recognise(
    node: ir.Node,
    layer: int,
    past_k: ir.Value,
    concat_k: tuple[ir.Value, ir.Value] | None,
    concat_v: tuple[ir.Value, ir.Value] | None,
) -> AttentionLayer:
    """``concat_k`` / ``concat_v``: (present, new) of the explicit cache Concat, None when the op takes the caches
    as its own past_key / past_value (then its key / value inputs are the new ``[B,S,H*D]`` tensors)."""
    ins = list(node.inputs) + [None] * (10 - len(node.inputs))
    h = int(attr_value(node, "num_heads", 0))
    need(h > 0, "num_heads is not set", node)
    own_past = concat_k is None
    unset = (
        ((3, "bias"), (8, "past_sequence_length"))
        if own_past
        else ((3, "bias"), (6, "past_key"), (7, "past_value"), (8, "past_sequence_length"))
    )
    for index, what in unset:
        need(ins[index] is None, f"input {what} is set: not converted", node)
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
    if concat_k is not None and concat_v is not None:
        need(reaches(key, concat_k[0], 80), "the op's key does not come from the key cache", key)
        need(reaches(value, concat_v[0], 80), "the op's value does not come from the value cache", value)
    width = static_width(query)
    need(width is not None and width % h == 0, f"query width {width} is not {h} heads x head size", query)
    assert width is not None
    d = width // h
    kvh = static_dim(past_k, 1)
    need(kvh is not None and h % kvh == 0, f"key cache heads {kvh} do not divide {h} query heads", past_k)
    assert kvh is not None
    if concat_k is not None and concat_v is not None:
        k_bsd, v_bsd = _bsd(concat_k[1], "key"), _bsd(concat_v[1], "value")
    else:
        # the op's own past: one KV head per query head, new keys / values [B,S,H*D] (BNSH past, schema)
        need(kvh == h, f"key cache heads {kvh}, expected the op's {h} heads (past_key is BNSH)", past_k)
        for what, v in (("key", key), ("value", value)):
            rank = len(v.shape) if v.shape is not None else None
            need(rank == 3, f"new {what} has rank {rank}, expected 3 ([batch, seq, heads * head])", v)
        k_bsd, v_bsd = key, value
    for what, v in (("key", k_bsd), ("value", v_bsd)):
        w = static_width(v)
        need(w in (None, kvh * d), f"new {what} width {w}, expected {kvh} heads x {d}", v)
    need(d % 8 == 0, f"head size {d} is not a multiple of 8 (PagedAttention)", query)
    if len(node.outputs) > 1:
        need(not any(o.uses() for o in node.outputs[1:]), "the op's present / qk outputs are used", node)
    form = "past_key / past_value into the op" if own_past else "cache Concat + repeat_kv before the op"
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
        notes=[f"{OP_TYPE} ({form}; mask from attention_mask)"],
        layout="bsd",
        source=OP_TYPE,
    )
