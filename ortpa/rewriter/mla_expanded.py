"""MLA prefill in the expanded form: fresh prompts attend at 192 / 128 per head instead of the 576-wide latent.

Absorbed attention (:mod:`ortpa.rewriter.mla`) scores every query against the 576-wide latent row and sums 512-wide
values; a prompt with no cached prefix can instead up-project its own new latent rows through ``kv_b_proj`` to
per-head ``k_nope`` / ``v`` and attend at ``qk_nope + qk_rope`` / ``v_head`` (vLLM's and SGLang's MLA prefill):
about 3.4x fewer attention FLOPs at DeepSeek dimensions (:func:`attention_flops_per_token`).

A step's rows are split once per graph (:class:`PrefillSplit`, built by :mod:`ortpa.rewriter.mla_prefill`):

* rows of a *fresh* sequence (``past_sequence_lengths == 0``) go through :func:`expanded_attention`: causal
  attention over that sequence's new tokens only, on a ``[fresh sequences, longest fresh prompt]`` grid padded at
  the end of each row (so a sequence's sums never see another's), and their latent rows are written to the cache
  by one ``ScatterND`` at the slots the absorbed op would use;
* the other rows (decodes, chunks with a cached prefix) keep the PagedAttention LATENT node, fed with the
  gathered rows and their own cumulative lengths (fresh sequences then have zero tokens in it);
* the two outputs are put back in token order by one ``Gather``.

The per-sequence flow treats each layer's construction as one op with PagedAttention's per-sequence semantics
(:class:`Composite`): its output rows are per token when its data inputs are.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import Builder
from ortpa.rewriter.derived import constant_recipe, copy_recipe

__all__ = [
    "QUERY_BLOCKS",
    "Composite",
    "PrefillForm",
    "PrefillSplit",
    "QueryBlock",
    "TrackingBuilder",
    "attention_flops_per_token",
    "expanded_attention",
    "query_blocks",
]

PrefillForm = Literal["expanded", "absorbed"]

# query blocks of the expanded attention: the float32 scores of a prompt of M tokens take M * ceil(M / 4) * H
# floats at a time instead of M * M * H (at 8k tokens and 16 heads 1 GiB, not 4). Each block is a handful of
# kernels that a decode step dispatches on zero-size tensors, so the count stays small (docs/mla_prefill.md)
QUERY_BLOCKS = 4


@dataclass(frozen=True)
class Composite:
    """A group of the rewriter's nodes that acts as one attention op: ``output`` (rank ``rank``) rows are per
    token (axis ``axis``) exactly when ``inputs`` are, as for PagedAttention; ``nodes`` are the group's own."""

    output: ir.Value
    rank: int
    axis: int
    inputs: tuple[ir.Value, ...]
    nodes: frozenset[ir.Node]


@dataclass(frozen=True)
class QueryBlock:
    """Query rows ``[start, end)`` of the grid (int64 ``[1]`` each), attending keys ``[0, end)`` under ``mask``
    ``[S, 1, end - start, end]`` (the grid mask's block): the same for every layer, built once per graph."""

    start: ir.Value
    end: ir.Value
    mask: ir.Value


@dataclass
class PrefillSplit:
    """A step's rows split into fresh prefill (expanded) and the rest (absorbed), built once per graph.

    All int64 unless said: ``abs_rows [T_a]`` the absorbed rows in token order; ``cu_abs`` int32 ``[B+1]`` their
    cumulative lengths; ``metadata`` int32 ``[2]`` the host bounds for the absorbed node (or None);
    ``grid_tok [S, M]`` the fresh sequences' tokens (padding clamped onto real tokens); ``grid_mask [S, 1, M, M]``
    bool causal mask; ``merge [T]`` each token's row in ``Concat(absorbed rows, grid rows)``; ``write_rows [n]`` /
    ``write_index [n, 2]`` the fresh tokens written to the cache and their (block, offset); ``blocks`` the grid's
    query blocks (:data:`QUERY_BLOCKS`), shared by every layer.
    """

    abs_rows: ir.Value
    cu_abs: ir.Value
    metadata: ir.Value | None
    grid_tok: ir.Value
    grid_mask: ir.Value
    merge: ir.Value
    write_rows: ir.Value
    write_index: ir.Value
    blocks: list[QueryBlock] = field(default_factory=list)
    nodes: set[ir.Node] = field(default_factory=set)
    composites: list[Composite] = field(default_factory=list)


class TrackingBuilder(Builder):
    """A :class:`Builder` that records the nodes it appends (the members of a :class:`Composite`)."""

    def __init__(self, graph: ir.Graph, prefix: str, nodes: set[ir.Node]) -> None:
        super().__init__(graph, prefix)
        self.nodes = nodes

    def op(self, op_type: str, inputs: Iterable[ir.Value | None], attributes: dict | None = None, **kw):
        out = super().op(op_type, inputs, attributes, **kw)
        first = out[0] if isinstance(out, tuple) else out
        node = first.producer()
        assert node is not None
        self.nodes.add(node)
        return out


def expanded_attention(
    b: Builder,
    split: PrefillSplit,
    *,
    q_nope: ir.Value,
    q_pe: ir.Value,
    latent: ir.Value,
    k_pe: ir.Value,
    w_kv_b: np.ndarray,
    num_heads: int,
    qk_nope: int,
    v_head: int,
    scale: float,
    derived: dict[str, dict] | None = None,
    kv_b_weight: ir.Value | None = None,
) -> ir.Value:
    """Causal attention of the fresh sequences over their own new tokens, float32 ``[S * M, H * V]``.
    ``derived``: where the recipes of the scale constant (:func:`ortpa.rewriter.derived.constant_recipe`: a
    whole-model dtype change rounds it, where the absorbed node's ``scale`` attribute stays exact) and of the copy
    of ``kv_b_weight`` (the original's initializer ``w_kv_b`` comes from) go.

    ``q_nope`` ``[1, H, T, P]``, ``q_pe`` ``[1, H, T, R]`` (after RoPE), ``latent`` ``[1, 1, T, L]``, ``k_pe``
    ``[1, 1, T, R]`` (after RoPE): the model's own values over all packed tokens. Row ``s * M + i`` of the result
    is query ``i`` of the ``s``-th fresh sequence (rows past its length are padding, never gathered back).
    """
    f32 = ir.DataType.FLOAT
    H, P, V = num_heads, qk_nope, v_head
    L = w_kv_b.shape[0]
    tok = split.grid_tok
    # queries [S, H, M, P + R]: gathered per grid cell, heads after the sequence axis
    q = b.op("Cast", [b.op("Concat", [q_nope, q_pe], {"axis": -1})], {"to": f32})
    q = b.op("Squeeze", [q, b.ints([0])])  # [H, T, P + R]
    q = b.op("Transpose", [b.op("Gather", [q, tok], {"axis": 1})], {"perm": [1, 0, 2, 3]})
    scale_value = b.initializer(np.array(scale, np.float32), "scale")
    if derived is not None:
        derived[scale_value.name] = constant_recipe(scale)
    q = b.op("Mul", [q, scale_value])
    # k_nope / v from the new latent rows: [S, M, L] @ [L, H * (P + V)] -> [S, H, M, P + V]; the weight in the
    # model's own type (it replaces the dense kv_b_proj, which is no longer read: the file does not grow)
    lat = b.op("Reshape", [latent, b.ints([-1, L])])
    w = b.initializer(w_kv_b.astype((latent.dtype or q_nope.dtype or f32).numpy()), "w_kv_b")
    if derived is not None and kv_b_weight is not None and kv_b_weight.is_initializer():
        derived[w.name] = copy_recipe(kv_b_weight.name)
    kv = b.op("Cast", [b.op("MatMul", [b.op("Gather", [lat, tok]), w])], {"to": f32})
    kv = b.op("Transpose", [b.op("Reshape", [kv, b.ints([0, 0, H, P + V])])], {"perm": [0, 2, 1, 3]})
    k_nope, v = b.op("Split", [kv, b.ints([P, V])], {"axis": -1}, num_outputs=2)
    # the one rope key of each token, broadcast to every head
    kpe = b.op("Cast", [b.op("Squeeze", [k_pe, b.ints([0, 1])])], {"to": f32})  # [T, R]
    kpe = b.op("Unsqueeze", [b.op("Gather", [kpe, tok]), b.ints([1])])  # [S, 1, M, R]
    heads = b.op("Concat", [b.op("Shape", [k_nope], {"end": 3}), b.op("Shape", [kpe], {"start": 3})], {"axis": 0})
    kpe = b.op("Expand", [kpe, heads])  # [S, H, M, R]
    k_t = b.op("Transpose", [b.op("Concat", [k_nope, kpe], {"axis": -1})], {"perm": [0, 1, 3, 2]})  # [S, H, P+R, M]
    o = _blocked_attention(b, split.blocks, q, k_t, v)  # [S, H, M, V]
    o = b.op("Transpose", [o], {"perm": [0, 2, 1, 3]})
    return b.op("Reshape", [o, b.ints([-1, H * V])], hint="expanded_out")


def query_blocks(b: Builder, grid_tok: ir.Value, grid_mask: ir.Value, blocks: int) -> list[QueryBlock]:
    """The grid's ``M`` query rows in ``blocks`` blocks of ``ceil(M / blocks)`` rows (the last ones short or empty:
    Slice clamps, and a step without fresh rows has ``M = 0``), each with its block of the causal mask."""
    zero = b.ints([0])
    m = b.op("Shape", [grid_tok], {"start": 1, "end": 2})
    rows = b.op("Div", [b.op("Add", [m, b.ints([blocks - 1])]), b.ints([blocks])])
    out = []
    for j in range(blocks):
        start = b.op("Min", [b.op("Mul", [rows, b.ints([j])]), m])
        end = b.op("Min", [b.op("Mul", [rows, b.ints([j + 1])]), m])
        corner = b.op("Concat", [end, end], {"axis": 0})
        mask = b.op("Slice", [grid_mask, b.op("Concat", [start, zero], {"axis": 0}), corner, b.ints([2, 3])])
        out.append(QueryBlock(start, end, mask))
    return out


def _blocked_attention(b: Builder, blocks: list[QueryBlock], q: ir.Value, k_t: ir.Value, v: ir.Value) -> ir.Value:
    """Causal attention of ``q`` ``[S, H, M, D]`` over ``k_t`` ``[S, H, D, M]`` / ``v`` ``[S, H, M, V]``, one
    query block at a time, each against the keys up to its last row only.

    The same arithmetic row by row as one ``[S, H, M, M]`` product (each row's softmax and value sum are its
    own), but the float32 scores live one block at a time (at 8k tokens and 16 heads: 1 GiB a block instead of
    4 GiB), and the masked upper triangle past each block's last row is never computed."""
    zero, two, three = b.ints([0]), b.ints([2]), b.ints([3])
    masked = b.initializer(np.array(-np.inf, np.float32), "masked")
    outs = []
    for blk in blocks:
        s = b.op("MatMul", [b.op("Slice", [q, blk.start, blk.end, two]), b.op("Slice", [k_t, zero, blk.end, three])])
        p = b.op("Softmax", [b.op("Where", [blk.mask, s, masked])], {"axis": -1})  # the diagonal is always allowed
        outs.append(b.op("MatMul", [p, b.op("Slice", [v, zero, blk.end, two])]))  # [S, H, rows, V]
    return outs[0] if len(outs) == 1 else b.op("Concat", outs, {"axis": 2})


def attention_flops_per_token(
    context: int, *, num_heads: int, kv_lora_rank: int, qk_nope: int, qk_rope: int, v_head: int, causal: bool = True
) -> dict[str, float]:
    """Attention FLOPs per prefill token of a ``context``-token fresh prompt, both forms, exact from the shapes.

    Counted: the score and value products (2 FLOPs per multiply-add), averaged over the causal triangle when
    ``causal`` (token ``i`` attends ``i + 1`` keys); the expanded form adds its per-token up-projection of the
    latent through ``kv_b_proj``, the absorbed form its per-token ``q_nope @ W_UK`` and ``o @ W_UV``.
    """
    H, L, P, R, V = num_heads, kv_lora_rank, qk_nope, qk_rope, v_head
    keys = (context + 1) / 2 if causal else context
    absorbed = 2 * H * keys * ((L + R) + L) + 2 * H * (P * L + L * V)
    expanded = 2 * H * keys * ((P + R) + V) + 2 * L * H * (P + V)
    return {"absorbed": absorbed, "expanded": expanded, "ratio": absorbed / expanded}
