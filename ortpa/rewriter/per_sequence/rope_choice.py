"""LongRoPE's table choice inside a source attention op -> per sequence, with RoPE applied in the graph.

onnxruntime-genai's Phi-3.x 128k / Phi-4-mini builds give every ``GroupQueryAttention`` the outputs of one
``If(Greater(total_sequence_length, original_max), long tables, short tables)``: one cos/sin table for the whole
batch, chosen from the batch's total length. Run alone, a sequence's step uses the table its own total length
(past + new tokens) picks; its cached keys keep the rotation they were written with. PagedAttention takes one
table for every packed token, so the converted graph applies RoPE itself, before the op (``do_rotary=0``): each
token's cos/sin row is gathered from the table its own sequence's total length picks (:func:`apply`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ortpa.rewriter import packed
from ortpa.rewriter._graph import Builder, const_array
from ortpa.rewriter.layer import SourceRotary

__all__ = ["ChosenRotary", "apply", "chosen_rotary", "rewrite_rotary_embedding_choices"]

_COMPARISONS = {"Greater": "Greater", "GreaterOrEqual": "GreaterOrEqual"}


@dataclass(frozen=True)
class ChosenRotary(SourceRotary):
    """A rotary whose tables are chosen at run time: ``then_*`` when ``total {op} threshold``, else ``else_*``."""

    then_cos: np.ndarray
    then_sin: np.ndarray
    else_cos: np.ndarray
    else_sin: np.ndarray
    threshold: int
    op: str  # "Greater" or "GreaterOrEqual"


def _strip(value: ir.Value | None) -> ir.Value | None:
    while value is not None and (node := value.producer()) is not None and node.op_type in ("Cast", "Identity"):
        value = node.inputs[0]
    return value


def _branch_tables(graph: ir.Graph) -> list[np.ndarray] | None:
    """The outputs of a branch made only of constants, as arrays."""
    out = []
    for value in graph.outputs:
        arr = const_array(value)
        if arr is None:
            node = value.producer()
            attr = node.attributes.get("value") if node is not None and node.op_type == "Constant" else None
            arr = attr.value.numpy() if attr is not None else None
        if arr is None:
            return None
        out.append(np.asarray(arr))
    return out


def chosen_rotary(cos: ir.Value, sin: ir.Value, total: ir.Value | None, interleaved: int) -> ChosenRotary | str:
    """``cos`` / ``sin`` from one ``If`` on ``total`` (the op's total_sequence_length) -> the choice; why not."""
    node = cos.producer()
    if node is None or node.op_type != "If" or sin.producer() is not node:
        return "they are not the two outputs of one If"
    if list(node.outputs[:2]) != [cos, sin]:
        return f"If {node.name} does not output (cos, sin) in that order"
    cond = node.inputs[0].producer() if node.inputs[0] is not None else None
    if cond is None or cond.op_type not in _COMPARISONS:
        return f"If {node.name}'s condition is not a Greater / GreaterOrEqual comparison"
    limit = const_array(cond.inputs[1])
    if limit is None or limit.size != 1:
        return f"{cond.op_type} {cond.name} does not compare with a constant"
    if total is None or _strip(cond.inputs[0]) is not _strip(total):
        return (
            f"{cond.op_type} {cond.name} does not compare the op's total_sequence_length (the sequence's past + new "
            "tokens alone), so the choice is not one per sequence"
        )
    then_attr, else_attr = node.attributes.get("then_branch"), node.attributes.get("else_branch")
    if then_attr is None or else_attr is None:
        return f"If {node.name} has no branches"
    then_tables, else_tables = _branch_tables(then_attr.value), _branch_tables(else_attr.value)
    if then_tables is None or else_tables is None or len(then_tables) != 2 or len(else_tables) != 2:
        return f"If {node.name}'s branches are not two constant tables each"
    shapes = {t.shape[1:] for t in then_tables + else_tables}
    if len(shapes) != 1 or any(t.ndim != 2 for t in then_tables + else_tables):
        return f"If {node.name}'s tables have different widths ({[t.shape for t in then_tables + else_tables]})"
    return ChosenRotary(
        cos, sin, interleaved, *then_tables, *else_tables, int(limit.reshape(-1)[0]), _COMPARISONS[cond.op_type]
    )


def _tables(b: Builder, io: packed.PagedIO, rot: ChosenRotary, dtype: ir.DataType) -> tuple[ir.Value, ir.Value]:
    """``[T, half]`` cos / sin per packed token, from the table its own sequence's total length picks."""
    key = (rot.cos, dtype)
    if key in io.rope_tables:
        return io.rope_tables[key]
    pos = packed.positions(b, io)
    total = packed.total_length(b, io)
    cond = b.op(rot.op, [total, b.initializer(np.array(rot.threshold, np.int64), "threshold")])
    cond = b.op("Unsqueeze", [cond, b.ints([1])])
    out = []
    for then, other, what in ((rot.then_cos, rot.else_cos, "cos"), (rot.then_sin, rot.else_sin, "sin")):
        rows = []
        for table in (then, other):
            # the table not chosen may be shorter than the positions: clamp (its rows are never selected then)
            at = b.op("Min", [pos, b.initializer(np.array(table.shape[0] - 1, np.int64), "last_row")])
            rows.append(b.op("Gather", [b.initializer(table.astype(dtype.numpy()), f"{what}_table"), at]))
        value = b.op("Where", [cond, rows[0], rows[1]], hint=f"{what}_per_token")
        io.per_token[value] = (2, 0)
        out.append(value)
    io.rope_tables[key] = (out[0], out[1])
    return out[0], out[1]


def apply(
    b: Builder, io: packed.PagedIO, rot: ChosenRotary, x: ir.Value, heads: int, d: int, dtype: ir.DataType
) -> ir.Value:
    """RoPE on ``x`` ``[T, heads * d]`` (the first ``2 * half`` channels of each head), as the source op does."""
    cos, sin = _tables(b, io, rot, dtype)
    half = int(rot.then_cos.shape[1])
    r = 2 * half
    x3 = b.op("Reshape", [x, b.ints([-1, heads, d])])
    c, s = (b.op("Unsqueeze", [t, b.ints([1])]) for t in (cos, sin))  # [T, 1, half]

    def part(lo: int, hi: int) -> ir.Value:
        return b.op("Slice", [x3, b.ints([lo]), b.ints([hi]), b.ints([2])])

    if rot.interleaved:
        pairs = b.op("Reshape", [part(0, r), b.ints([0, heads, half, 2])])
        x0 = b.op("Squeeze", [b.op("Slice", [pairs, b.ints([0]), b.ints([1]), b.ints([3])]), b.ints([3])])
        x1 = b.op("Squeeze", [b.op("Slice", [pairs, b.ints([1]), b.ints([2]), b.ints([3])]), b.ints([3])])
        o0 = b.op("Sub", [b.op("Mul", [x0, c]), b.op("Mul", [x1, s])])
        o1 = b.op("Add", [b.op("Mul", [x1, c]), b.op("Mul", [x0, s])])
        pieces = [b.op("Unsqueeze", [o, b.ints([3])]) for o in (o0, o1)]
        rotated = b.op("Reshape", [b.op("Concat", pieces, {"axis": 3}), b.ints([0, heads, r])])
    else:
        x1, x2 = part(0, half), part(half, r)
        o1 = b.op("Sub", [b.op("Mul", [x1, c]), b.op("Mul", [x2, s])])
        o2 = b.op("Add", [b.op("Mul", [x2, c]), b.op("Mul", [x1, s])])
        rotated = b.op("Concat", [o1, o2], {"axis": 2})
    if r < d:
        rotated = b.op("Concat", [rotated, part(r, d)], {"axis": 2})
    return b.op("Reshape", [rotated, b.ints([-1, heads * d])], hint="rotated")


def _reads_width(value: ir.Value | None, tensor: ir.Value) -> bool:
    """``value`` is dim 1 of ``tensor`` read with Shape (``Gather(Shape(t), 1)`` or ``Shape(t)[1:2]``)."""
    while value is not None and (node := value.producer()) is not None and node.op_type in _LAYOUT:
        value = node.inputs[0]
    node = value.producer() if value is not None else None
    if node is None:
        return False
    if node.op_type == "Gather":
        idx = const_array(node.inputs[1])
        shape = node.inputs[0].producer() if node.inputs[0] is not None else None
        return (
            idx is not None
            and idx.size == 1
            and int(idx.reshape(-1)[0]) == 1
            and shape is not None
            and shape.op_type == "Shape"
            and shape.inputs[0] is tensor
            and not shape.attributes.get("start")
        )
    if node.op_type == "Shape" and node.inputs[0] is tensor:
        start, end = node.attributes.get("start"), node.attributes.get("end")
        return start is not None and int(start.value) == 1 and end is not None and int(end.value) == 2
    return False


_LAYOUT = frozenset({"Cast", "Identity", "Squeeze", "Unsqueeze", "Reshape"})


def rewrite_rotary_embedding_choices(
    graph: ir.Graph, io: packed.PagedIO, order: list[ir.Node], b: Builder
) -> list[str]:
    """``com.microsoft::RotaryEmbedding`` nodes whose cos/sin tables come from LongRoPE's ``If`` on the dense
    ``attention_mask`` width (the genai builder's fp16 form) -> one row per packed token from the table its own
    sequence's total length picks, indexed by the token's packed index. One line per node rewritten."""
    mask = io.dense_inputs.get("attention_mask")
    if mask is None:
        return []
    done = []
    for node in order:
        if node.op_type != "RotaryEmbedding" or node.domain != "com.microsoft" or len(node.inputs) < 4:
            continue
        cos, sin = node.inputs[2], node.inputs[3]
        choice = cos.producer() if cos is not None else None
        if cos is None or sin is None or choice is None or choice.op_type != "If":
            continue
        cond = choice.inputs[0].producer() if choice.inputs[0] is not None else None
        if cond is None or not cond.inputs or not _reads_width(cond.inputs[0], mask):
            continue
        interleaved = int(node.attributes["interleaved"].value) if "interleaved" in node.attributes else 0
        rot = chosen_rotary(cos, sin, cond.inputs[0], interleaved)
        if isinstance(rot, str):
            continue  # left to the checks that follow, which refuse what stays step-wide
        dtype = cos.dtype or ir.DataType.from_numpy(rot.then_cos.dtype)  # the tables' own type
        cos_t, sin_t = _tables(b, io, rot, dtype)
        index = b.op("Unsqueeze", [packed.token_index(b, io), b.ints([0])], hint="row_per_token")
        io.per_token[index] = (2, 1)
        for slot, value in ((1, index), (2, cos_t), (3, sin_t)):
            node.replace_input_with(slot, value)
        done.append(
            f"RotaryEmbedding node {node.name!r}: cos/sin of If {choice.name!r} (one table per step) -> each token's "
            "row from the table its own sequence's total length picks"
        )
    return done
