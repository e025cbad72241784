"""The two cache forms of dense MLA, traced to the same parts (see :mod:`ortpa.rewriter.recognisers.mla`).

transformers 5 caches the normalised latent and the roped k_pe, and kv_b_proj expands the whole present latent;
transformers 4.x (optimum, dynamo exports of it) caches the expanded per-head keys ``Concat(k_nope, Expand(k_pe))``
and values ``v``, computed by kv_b_proj from the new latent rows. Either way :class:`CachedParts` names the new
normalised latent rows, the one roped k_pe head, kv_b_proj's k_nope / v and its weight; nothing here mutates the
graph.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import const_array, consumers, int_attr, ints_attr, producer_op, split_sizes, static_dim
from ortpa.rewriter.quantized import OP_TYPE as OP_NBITS
from ortpa.rewriter.quantized import dequantized_weight, is_matmul_nbits
from ortpa.rewriter.recognisers._match import cache_concat, consumer_ops, need

__all__ = ["CachedParts", "describe_value", "expanded_cache", "find_k_pe_raw", "latent_cache"]


@dataclass(frozen=True)
class CachedParts:
    """What a layer's caches are made of, traced to kv_b_proj: the new normalised latent rows, the roped k_pe
    (one head), kv_b_proj's k_nope and the v the attention's probabilities multiply, and the widths."""

    latent: ir.Value
    k_pe: ir.Value
    k_nope: ir.Value
    v: ir.Value
    w_kv_b: np.ndarray
    P: int
    V: int
    R: int
    form: str
    present_key: ir.Value | None = None  # the expanded form: the attention's key is this cache, past rows and new
    kv_b_weight: ir.Value | None = None  # kv_b_proj's float weight (not MatMulNBits): derived weights' source


def describe_value(value: ir.Value) -> str:
    node = value.producer()
    return "a graph input or constant" if node is None else f"{node.op_type} ({node.name})"


def find_k_pe_raw(latent: ir.Value, k_pe: ir.Value, rope: int) -> ir.Value | None:
    """k_pe before RoPE: the other output of the Split of kv_a_proj_with_mqa that also yields the latent."""
    latent_nodes: set[int] = set()
    queue, seen = deque([latent]), 0
    while queue and seen < 60:
        node = queue.popleft().producer()
        seen += 1
        if node is None:
            continue
        latent_nodes.add(id(node))
        queue.extend(v for v in node.inputs if v is not None and v.const_value is None)
    queue, seen = deque([k_pe]), 0
    while queue and seen < 60:
        value = queue.popleft()
        node = value.producer()
        seen += 1
        if node is None:
            continue
        if node.op_type == "Split" and id(node) in latent_nodes and len(node.outputs) == 2:
            return value
        queue.extend(v for v in node.inputs if v is not None and v.const_value is None)
    return None


def _kv_b_proj(kvb: ir.Node | None, L: int | None, where: ir.Value) -> np.ndarray:
    """kv_b_proj's ``[L, H*(P+V)]`` weight (dequantized from MatMulNBits)."""
    need(kvb is not None, f"the latent is not expanded by a MatMul (kv_b_proj) but {describe_value(where)}", where)
    assert kvb is not None
    w_kv_b = dequantized_weight(kvb) if is_matmul_nbits(kvb) else const_array(kvb.inputs[1])
    need(
        w_kv_b is not None and w_kv_b.ndim == 2 and w_kv_b.shape[0] == (L or w_kv_b.shape[0]),
        "kv_b_proj weight not a constant [L, N]",
        kvb,
    )
    assert w_kv_b is not None
    return w_kv_b


def _float_weight(kvb: ir.Node | None) -> ir.Value | None:
    return None if kvb is None or is_matmul_nbits(kvb) else kvb.inputs[1]


def latent_cache(past_k: ir.Value, past_v: ir.Value) -> CachedParts:
    """transformers 5: the caches hold the normalised latent and the roped k_pe; kv_b_proj expands the whole
    present latent (past rows too) into per-head k_nope / v."""
    L, R = static_dim(past_k, 3), static_dim(past_v, 3)
    need(L is not None and R is not None, "latent / rope widths of the caches are not static", past_k)
    assert L is not None and R is not None
    latent_all, latent = cache_concat(past_k)
    _, k_pe = cache_concat(past_v)
    kvb = next(
        (
            n
            for n in consumers(latent_all, "MatMul", OP_NBITS)
            if n.inputs[0] is latent_all and (n.op_type == "MatMul" or is_matmul_nbits(n))
        ),
        None,
    )
    need(
        kvb is not None,
        f"present latent is not expanded by a MatMul (kv_b_proj); consumers {consumer_ops(latent_all)}",
        latent_all,
    )
    assert kvb is not None
    w_kv_b = _kv_b_proj(kvb, L, latent_all)
    reshape = next(iter(consumers(kvb.outputs[0], "Reshape")), None)
    transpose = next(iter(consumers(reshape.outputs[0], "Transpose")), None) if reshape else None
    need(
        transpose is not None and ints_attr(transpose, "perm") == [0, 2, 1, 3],
        "kv_b_proj output not Reshape->Transpose(0,2,1,3)",
        kvb,
    )
    assert transpose is not None
    split = next(iter(consumers(transpose.outputs[0], "Split")), None)
    need(
        split is not None and len(split.outputs) == 2,
        "expanded K/V is not Split into (k_nope, v)",
        transpose.outputs[0],
    )
    assert split is not None
    P, V = _split_pv(split)
    return CachedParts(
        latent, k_pe, split.outputs[0], split.outputs[1], w_kv_b, P, V, R, "latent cache", None, _float_weight(kvb)
    )


def expanded_cache(past_k: ir.Value, past_v: ir.Value) -> CachedParts:
    """transformers 4.x (optimum, dynamo exports of it): the caches hold the expanded per-head keys
    ``Concat(k_nope, Expand(k_pe))`` and values ``v``, both from kv_b_proj of the new latent rows. Traced back to
    that latent and the one roped k_pe head, the layer is the same MLA: the paged cache holds ``[latent | k_pe]``
    instead (the dense caches are replaced by paged ones anyway), H * (P + R + V) / (L + R) times smaller."""
    present_v, v = cache_concat(past_v)
    present_k, new_k = cache_concat(past_k)
    split = producer_op(v, "Split")
    need(
        split is not None and len(split.outputs) == 2 and split.outputs[1] is v,
        f"the new value is not the v of a Split (k_nope, v) of kv_b_proj's expansion but {describe_value(v)}",
        v,
    )
    assert split is not None
    P, V = _split_pv(split)
    k_nope = split.outputs[0]
    transpose = producer_op(split.inputs[0], "Transpose")
    reshape = producer_op(transpose.inputs[0], "Reshape") if transpose else None
    need(
        transpose is not None and ints_attr(transpose, "perm") == [0, 2, 1, 3] and reshape is not None,
        "expanded K/V is not kv_b_proj's output through Reshape->Transpose(0,2,1,3)",
        split.inputs[0],
    )
    assert reshape is not None
    kvb = producer_op(reshape.inputs[0], "MatMul", OP_NBITS)
    kvb = kvb if kvb is not None and (kvb.op_type == "MatMul" or is_matmul_nbits(kvb)) else None
    w_kv_b = _kv_b_proj(kvb, None, reshape.inputs[0])
    assert kvb is not None
    latent = kvb.inputs[0]
    assert latent is not None
    concat = producer_op(new_k, "Concat")
    need(
        concat is not None
        and len(concat.inputs) == 2
        and concat.inputs[0] is k_nope
        and int_attr(concat, "axis") in (-1, 3),
        f"the new key is not Concat(k_nope, k_pe, axis=-1) of kv_b_proj's k_nope but {describe_value(new_k)}",
        new_k,
    )
    assert concat is not None and concat.inputs[1] is not None
    k_pe = concat.inputs[1]
    expand = producer_op(k_pe, "Expand")  # the one roped head broadcast to every head
    k_pe = expand.inputs[0] if expand is not None and expand.inputs[0] is not None else k_pe
    need(
        expand is not None or static_dim(k_pe, 1) == 1,
        f"the key's rope part ({k_pe.name}) is neither one head broadcast by an Expand nor one head",
        k_pe,
    )
    width = static_dim(past_k, 3)
    need(width is not None and width > P, f"key cache width {width} is not static and wider than qk_nope {P}", past_k)
    assert width is not None
    R = width - P
    need(static_dim(past_v, 3) in (None, V), f"value cache width {static_dim(past_v, 3)}, expected v {V}", past_v)
    # k_pe must be ONE head: computed from the R-wide sibling of the latent in kv_a_proj's Split (a per-head
    # rope key would make the absorbed single-head cache wrong)
    raw = find_k_pe_raw(latent, k_pe, R)
    need(
        raw is not None and static_dim(raw, -1) == R,
        f"the key's rope part ({k_pe.name}) is not one R={R} head split off kv_a_proj with the latent",
        k_pe,
    )
    form = "expanded cache (transformers 4.x)"
    return CachedParts(latent, k_pe, k_nope, present_v, w_kv_b, P, V, R, form, present_k, _float_weight(kvb))


def _split_pv(split: ir.Node) -> tuple[int, int]:
    sizes = split_sizes(split)
    need(sizes is not None and len(sizes) == 2, "Split sizes of (k_nope, v) are not constant", split)
    assert sizes is not None
    return sizes[0], sizes[1]
