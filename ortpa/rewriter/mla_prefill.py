"""The per-step row split of a converted MLA graph: fresh prefill (expanded form) against the rest (absorbed).

:func:`prefill_split` builds, once per graph, the index tensors :mod:`ortpa.rewriter.mla_expanded` and the
absorbed node share (all derived from the paged inputs; nothing per layer): which sequences are fresh
(``past_sequence_lengths == 0`` with new tokens), the absorbed rows and their cumulative lengths, the fresh
sequences' padded grid and causal mask, the cache slots of the fresh tokens, and each token's row in the merged
output. :func:`expanded_reasons` says why a conversion keeps the absorbed form instead.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortpa.rewriter import packed
from ortpa.rewriter.layer import MlaLayer
from ortpa.rewriter.mla_expanded import QUERY_BLOCKS, PrefillSplit, TrackingBuilder, query_blocks

__all__ = ["expanded_reasons", "prefill_split", "register_composites"]

_I64 = ir.DataType.INT64
_INT64_MAX = np.iinfo(np.int64).max


def expanded_reasons(layers: list[MlaLayer], *, rope_in_op: bool, int8_cache: bool) -> list[str]:
    """Why the expanded prefill form cannot apply to this conversion (empty: it applies)."""
    out = []
    if int8_cache:
        out.append("int8 KV cache: the expanded rows would have to be quantized in the graph as the op does")
    if rope_in_op:
        out.append("rope_in_op: the op ropes k_pe itself, the expanded form needs the graph's roped k_pe")
    return out


def prefill_split(graph: ir.Graph, io: packed.PagedIO, key_cache: ir.Value) -> PrefillSplit:
    """The split of a step's rows; ``key_cache`` (any layer's, they share their dims) gives the block size."""
    nodes: set[ir.Node] = set()
    b = TrackingBuilder(graph, "/mla/prefill_split", nodes)
    zero = b.ints([0])
    starts, ends = packed.sequence_bounds(b, io)
    seq = packed.sequence_of_token(b, io).seq
    in_seq = packed.index_in_sequence(b, io)
    q_len = b.op("Sub", [ends, starts])  # [B]
    past = b.op("Cast", [io.past_sequence_lengths], {"to": _I64})
    fresh_seq = b.op("And", [b.op("Equal", [past, b.ints([0])]), b.op("Greater", [q_len, b.ints([0])])])
    fresh_tok = b.op("Gather", [fresh_seq, seq])  # [T]
    kept_tok = b.op("Not", [fresh_tok])
    abs_rows = b.op("Reshape", [b.op("NonZero", [kept_tok]), b.ints([-1])], hint="absorbed_rows")
    kept_len = b.op("Where", [fresh_seq, zero, q_len])
    cu_abs = b.op("Concat", [zero, b.op("CumSum", [kept_len, b.ints([0])])], {"axis": 0})
    cu_abs = b.op("Cast", [cu_abs], {"to": ir.DataType.INT32}, hint="absorbed_cu")
    metadata = None
    if io.attention_metadata is not None:  # the upper bounds hold for a subset; the lower bound may not
        metadata = b.op("Slice", [io.attention_metadata, zero, b.ints([2])], hint="absorbed_metadata")

    # the fresh sequences' grid [S, M]: token c_lo[s] + i, clamped onto a real token in the padding
    sel = b.op("Reshape", [b.op("NonZero", [fresh_seq]), b.ints([-1])])
    sel_len = b.op("Gather", [q_len, sel])
    # over a padded 0 (no fresh sequence: 0), not a Concat with one: OpenVINO's CPU plug-in gives
    # ReduceMax(Concat(x, [0])) the Concat's shape
    max_q = b.op("ReduceMax", [b.op("Pad", [sel_len, b.ints([0, 1])]), zero], {"keepdims": 1})
    i = b.op("Range", [b.initializer(np.array(0, np.int64), "zero"), b.op("Squeeze", [max_q, zero]),
                       b.initializer(np.array(1, np.int64), "one")])  # fmt: skip
    count = b.op("Shape", [io.input_ids])
    last = b.op("Max", [b.op("Sub", [count, b.ints([1])]), zero])
    tok = b.op("Add", [b.op("Unsqueeze", [b.op("Gather", [starts, sel]), b.ints([1])]), b.op("Unsqueeze", [i, zero])])
    grid_tok = b.op("Min", [tok, last], hint="grid_tok")
    # key j attends to query i of sequence s when j <= i and j < its length: [S, 1, M(query), M(key)]
    qi = b.op("Unsqueeze", [i, b.ints([1])])
    kj = b.op("Unsqueeze", [i, zero])
    causal = b.op("LessOrEqual", [kj, qi])  # [M, M]
    live = b.op("Less", [kj, b.op("Unsqueeze", [sel_len, b.ints([1, 2])])])  # [S, 1, M]
    grid_mask = b.op("Unsqueeze", [b.op("And", [causal, live]), b.ints([1])], hint="grid_mask")

    # each token's row in Concat(absorbed rows, grid rows [S * M])
    kept_i = b.op("Cast", [kept_tok], {"to": _I64})
    rank_abs = b.op("Sub", [b.op("CumSum", [kept_i, b.ints([0])]), b.ints([1])])
    n_abs = b.op("Shape", [abs_rows])
    fresh_rank = b.op("Sub", [b.op("CumSum", [b.op("Cast", [fresh_seq], {"to": _I64}), b.ints([0])]), b.ints([1])])
    grid_row = b.op("Add", [b.op("Mul", [b.op("Gather", [fresh_rank, seq]), max_q]), in_seq])
    merge = b.op("Where", [fresh_tok, b.op("Add", [grid_row, n_abs]), rank_abs], hint="merge_rows")

    # the fresh tokens' slots: position = index in sequence (no past); pages through the block table
    bt = b.op("Cast", [io.block_table], {"to": _I64})
    n_blocks = b.op("Shape", [key_cache], {"start": 0, "end": 1})
    bs = b.op("Shape", [key_cache], {"start": 1, "end": 2})
    max_blocks = b.op("Shape", [bt], {"start": 1, "end": 2})
    blk = b.op("Div", [in_seq, bs])
    inside = b.op("Less", [blk, max_blocks])
    flat = b.op("Add", [b.op("Mul", [seq, max_blocks]), b.op("Min", [blk, b.op("Sub", [max_blocks, b.ints([1])])])])
    page = b.op("Where", [inside, b.op("Gather", [b.op("Reshape", [bt, b.ints([-1])]), flat]), b.ints([-1])])
    mapped = b.op("And", [b.op("GreaterOrEqual", [page, zero]), b.op("Less", [page, n_blocks])])
    write_rows = b.op("Reshape", [b.op("NonZero", [b.op("And", [fresh_tok, mapped])]), b.ints([-1])])
    offset = b.op("Mod", [in_seq, bs])
    index = b.op("Concat", [b.op("Unsqueeze", [page, b.ints([1])]), b.op("Unsqueeze", [offset, b.ints([1])])],
                 {"axis": 1})  # fmt: skip
    write_index = b.op("Gather", [index, write_rows], hint="fresh_write_index")
    return PrefillSplit(
        abs_rows=abs_rows,
        cu_abs=cu_abs,
        metadata=metadata,
        grid_tok=grid_tok,
        grid_mask=grid_mask,
        merge=merge,
        write_rows=write_rows,
        write_index=write_index,
        blocks=query_blocks(b, grid_tok, grid_mask, QUERY_BLOCKS),
        nodes=nodes,
    )


def register_composites(io: packed.PagedIO, split: PrefillSplit) -> None:
    """Hand the split's layers to the per-sequence flow (:attr:`packed.PagedIO.composites`)."""
    io.composites.extend(split.composites)
