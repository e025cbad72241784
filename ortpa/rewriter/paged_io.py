"""Dense past/present KV and mask I/O -> the paged interface (docs/converted_model.md).

Packed tokens: every sequence's new tokens form one row, so the converted graph runs the model body at batch 1
with ``seq = num_tokens``; everything per-token (embeddings, norms, MLPs, RoPE) is unchanged, and only the
attention needs sequence boundaries, which PagedAttention reads from ``cumulative_sequence_lengths``.

Inputs (names as onnxruntime-genai's paged models): ``input_ids`` int64[num_tokens],
``cumulative_sequence_lengths`` int32[batch+1], ``past_sequence_lengths`` int32[batch],
``block_table`` int32[batch, max_blocks], ``attention_metadata`` int32[3] (optional), ``position_ids``
int64[num_tokens] (optional: derived in-graph by default), ``logits_indices`` int64[num_logits] (optional, an
empty default: the rows a step's logits hold, :func:`_asked_rows`), per layer ``past_key_values.{i}.key``
``[num_blocks, block_size, 1, head]``. Outputs: ``logits`` and per layer ``present.{i}.key`` (the op's
``key_cache_out``, aliasing the cache input).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import onnx_ir as ir
from onnx_ir.passes.common import RemoveUnusedNodesPass

from ortpa.errors import ConversionError
from ortpa.rewriter._graph import Builder, const_array, int_attr
from ortpa.rewriter.packed import PagedIO, last_token_index, positions

__all__ = [
    "DENSE_PREFIX",
    "LOGITS_INDICES",
    "LogitsMode",
    "PagedIO",
    "PositionMode",
    "add_key_cache",
    "add_separate_caches",
    "begin",
    "finish",
    "route",
    "set_present",
    "set_present_value",
]

LogitsMode = Literal["last", "all"]
PositionMode = Literal["derive", "input"]
LOGITS_INDICES = "logits_indices"  # optional input: the packed tokens whose logits a step computes
DENSE_PREFIX = "dense."  # the dense graph's I/O is renamed out of the way while the paged I/O is built


def _input(name: str, dtype: ir.DataType, dims: list[int | str]) -> ir.Value:
    return ir.Value(name=name, shape=ir.Shape(dims), type=ir.TensorType(dtype))


def begin(graph: ir.Graph, *, attention_metadata: bool = True, position_ids: PositionMode = "derive") -> PagedIO:
    """Rename the dense I/O out of the way and add the paged inputs (the dense ones stay until :func:`finish`)."""
    names = {v.name for v in graph.inputs}
    for required in ("input_ids",):
        if required not in names:
            raise ConversionError(f"expected a graph input {required!r}; found inputs {sorted(names)}")
    dense_inputs = {}
    for v in graph.inputs:
        dense_inputs[v.name] = v
        v.name = DENSE_PREFIX + v.name
    dense_outputs = {}
    for v in graph.outputs:
        dense_outputs[v.name] = v
        v.name = DENSE_PREFIX + v.name
    io = PagedIO(
        input_ids=_input("input_ids", ir.DataType.INT64, ["num_tokens"]),
        cumulative_sequence_lengths=_input("cumulative_sequence_lengths", ir.DataType.INT32, ["batch_size_plus_1"]),
        past_sequence_lengths=_input("past_sequence_lengths", ir.DataType.INT32, ["batch_size"]),
        block_table=_input("block_table", ir.DataType.INT32, ["batch_size", "max_blocks_per_sequence"]),
        attention_metadata=_input("attention_metadata", ir.DataType.INT32, [3]) if attention_metadata else None,
        position_ids=_input("position_ids", ir.DataType.INT64, ["num_tokens"]) if position_ids == "input" else None,
        dense_inputs=dense_inputs,
        dense_outputs=dense_outputs,
        dense_nodes=frozenset(graph),
    )
    new = [io.input_ids, io.cumulative_sequence_lengths, io.past_sequence_lengths, io.block_table]
    new += [v for v in (io.attention_metadata, io.position_ids) if v is not None]
    graph.inputs.extend(new)
    return io


def add_key_cache(graph: ir.Graph, layer: int, head_size: int, dtype: ir.DataType) -> ir.Value:
    """Graph input ``past_key_values.{layer}.key`` ``[num_blocks, block_size, 1, head_size]`` (LATENT)."""
    value = _input(f"past_key_values.{layer}.key", dtype, ["num_blocks", "block_size", 1, head_size])
    graph.inputs.append(value)
    return value


def set_present(graph: ir.Graph, layer: int, key_cache_out: ir.Value, like: ir.Value) -> None:
    """Expose the op's ``key_cache_out`` as ``present.{layer}.key`` with the cache input's type and shape."""
    key_cache_out.name = f"present.{layer}.key"
    key_cache_out.type = like.type
    key_cache_out.shape = like.shape
    graph.outputs.append(key_cache_out)


def add_separate_caches(
    graph: ir.Graph, layer: int, kv_heads: int, head_size: int, dtype: ir.DataType
) -> tuple[ir.Value, ir.Value]:
    """Graph inputs ``past_key_values.{layer}.key`` / ``.value`` ``[num_blocks, block_size, kv_heads, head_size]``
    (SEPARATE)."""
    dims: list[int | str] = ["num_blocks", "block_size", kv_heads, head_size]
    key, value = (_input(f"past_key_values.{layer}.{kind}", dtype, dims) for kind in ("key", "value"))
    graph.inputs.extend([key, value])
    return key, value


def set_present_value(graph: ir.Graph, layer: int, value_cache_out: ir.Value, like: ir.Value) -> None:
    """Expose the op's ``value_cache_out`` as ``present.{layer}.value`` with the cache input's type and shape."""
    value_cache_out.name = f"present.{layer}.value"
    value_cache_out.type = like.type
    value_cache_out.shape = like.shape
    graph.outputs.append(value_cache_out)


def _select_logits(graph: ir.Graph, b: Builder, io: PagedIO, mode: LogitsMode) -> None:
    dense = io.dense_outputs.get("logits")
    if dense is None:
        raise ConversionError(f"expected a graph output 'logits'; found {sorted(io.dense_outputs)}")
    if mode == "all":
        logits = b.op("Squeeze", [dense, b.ints([0])])
    elif mode == "last":
        idx = _asked_rows(graph, b, io)
        mm = dense.producer()
        if mm is not None and mm.op_type == "MatMul" and const_array(mm.inputs[1]) is not None:
            # Gather the last hidden state of each sequence before lm_head: vocab-wide rows only where needed. The
            # batch axis goes before lm_head (hidden-wide rows), so the MatMul writes the graph output itself: a
            # Squeeze after it copied every vocab-wide row once more per step (2 MB at 16 rows of 32000).
            hidden = b.op("Squeeze", [b.op("Gather", [mm.inputs[0], idx], {"axis": 1}), b.ints([0])])
            logits = b.op("MatMul", [hidden, mm.inputs[1]])
        else:
            logits = b.op("Squeeze", [b.op("Gather", [dense, idx], {"axis": 1}), b.ints([0])])
    else:
        raise ConversionError(f"logits must be 'last' or 'all', got {mode!r}")
    logits.name = "logits"
    logits.type = dense.type
    vocab = dense.shape[-1] if dense.shape is not None else None
    # "batch_size": onnxruntime-genai sizes its logits buffer from this name (one row per sequence), and never feeds
    # logits_indices; a step that feeds it gets as many rows as it names
    logits.shape = ir.Shape(["batch_size" if mode == "last" else "num_tokens", vocab])
    graph.outputs.insert(0, logits)


def _asked_rows(graph: ir.Graph, b: Builder, io: PagedIO) -> ir.Value:
    """``[R]`` int64: the packed tokens whose logits a step computes. The optional input ``logits_indices`` names
    them (vLLM's logits indices: every position of a prompt being scored, the last of the others); when a step
    feeds none, each sequence's last token. The input's default is an empty initializer of the same name, so a
    runtime that does not know it (onnxruntime-genai) runs the model as before: one row per sequence."""
    asked = ir.Value(name=LOGITS_INDICES, shape=ir.Shape(["num_logits"]), type=ir.TensorType(ir.DataType.INT64))
    asked.const_value = ir.tensor(np.zeros(0, np.int64), name=LOGITS_INDICES)
    graph.inputs.append(asked)
    graph.register_initializer(asked)
    last = last_token_index(b, io)
    # counts as Shape ([1]), not Size (a scalar): the OpenVINO EP leaves Size to the CPU EP, which splits its subgraphs
    n = b.op("Shape", [asked], hint="logits_indices_count")
    zero = b.initializer(np.array(0, np.int64), "zero")
    none = b.op("Cast", [b.op("Equal", [n, zero])], {"to": ir.DataType.INT64})
    end = b.op("Add", [n, b.op("Mul", [none, b.op("Shape", [last])])])  # n if fed, else one row per sequence
    both = b.op("Concat", [asked, last], {"axis": 0})
    return b.op("Slice", [both, b.ints([0]), end, b.ints([0])], hint="logits_rows")


def _fold_cache_shapes(graph: ir.Graph, dense: ir.Value) -> None:
    """``Shape(past_key_values.*|attention_mask)`` slices of only batch (1 once packed) or static dims -> constants.

    The exporter reuses whichever input carries a symbolic dim, so live Reshape targets may read the batch size
    from the cache or mask inputs; once tokens are packed that is the constant 1.
    """
    if dense.shape is None:
        return
    dims: list[int | None] = [1] + [d if isinstance(d, int) else None for d in list(dense.shape)[1:]]
    for node in list(dense.consumers()):
        if node.op_type != "Shape":
            continue
        start, end = int_attr(node, "start", 0), int_attr(node, "end", len(dims))
        picked = dims[slice(start, end)]
        if all(d is not None for d in picked):
            b = Builder(graph, "/paged_io/cache_shape")
            node.outputs[0].replace_all_uses_with(b.ints([int(d) for d in picked]))


def route(model: ir.Model, io: PagedIO) -> None:
    """Point the dense graph's ``input_ids`` / ``position_ids`` uses at the packed ones (``[1, num_tokens]``).

    The pipeline then runs the per-sequence pass (:mod:`ortpa.rewriter.per_sequence`), then :func:`finish`.
    """
    graph = model.graph
    b = Builder(graph, "/paged_io/route")
    dense_ids = io.dense_inputs["input_ids"]
    dense_ids.replace_all_uses_with(b.op("Unsqueeze", [io.input_ids, b.ints([0])], hint="input_ids_packed"))
    dense_pos = io.dense_inputs.get("position_ids")
    if dense_pos is not None and dense_pos.uses():
        dense_pos.replace_all_uses_with(b.op("Unsqueeze", [positions(b, io), b.ints([0])], hint="position_ids_packed"))


def finish(model: ir.Model, io: PagedIO, *, logits: LogitsMode = "last") -> None:
    """Select logits, drop the dense I/O; raise if any of it is still needed (after :func:`route`)."""
    graph = model.graph
    b = Builder(graph, "/paged_io")
    _select_logits(graph, b, io, logits)
    for value in io.dense_outputs.values():
        graph.outputs.remove(value)
    RemoveUnusedNodesPass()(model)
    for name, value in io.dense_inputs.items():
        if name.startswith("past_key_values.") or name == "attention_mask":
            _fold_cache_shapes(graph, value)
    RemoveUnusedNodesPass()(model)
    still_used = [
        (name, f"still read by {sorted({n.op_type + ':' + (n.name or '?') for n in value.consumers()})[:4]}")
        for name, value in io.dense_inputs.items()
        if value.uses()
    ]
    if still_used:
        raise ConversionError("the dense inputs are still needed after the attention rewrite", still_used)
    for value in io.dense_inputs.values():
        graph.inputs.remove(value)
    graph.sort()
