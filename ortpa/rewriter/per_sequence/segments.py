"""What the dataflow (:mod:`ortpa.rewriter.per_sequence.flow`) finds step-wide -> segment ops, or a refusal.

* an ``enum`` (a token's index in the packed step) used as a value (``Gather(pos_table, Range(0, seq_len, 1))``,
  learned absolute positions) -> each token's index in its own sequence (``t - starts[seq(t)]``), which is what
  ``Range(0, seq_len, 1)`` gives the sequence run alone;
* the last (or first) token ``x[:, -1:]`` (``x[:, :1]``) broadcast back over the tokens -> each token's own
  sequence's last (first) token;
* every other value the flow calls step-wide, reaching the logits or the caches, is refused with its node and
  the reason.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortpa.rewriter import packed
from ortpa.rewriter._graph import Builder, const_array
from ortpa.rewriter.per_sequence.axes import Live, describe, live_nodes
from ortpa.rewriter.per_sequence.flow import _ELEMENTWISE, Flow, Kind, analyse

__all__ = ["flow_rewrites", "run_flow"]

_MAX_ROUNDS = 4


def _trusted(live: Live, seeds: list[ir.Value], dense: frozenset) -> set[ir.Node]:
    """The rewriter's own nodes behind the seeds (index arithmetic on the paged inputs, segment ops); the dense
    graph's nodes they read, and what feeds those, are analysed as any other."""
    out: set[ir.Node] = set()
    stack = [v.producer() for v in seeds if v.producer() is not None]
    while stack:
        node = stack.pop()
        if node in out or node in dense:
            continue
        out.add(node)
        stack.extend(x.producer() for x in node.inputs if x is not None and x.producer() is not None)
    return out


def run_flow(graph: ir.Graph, io: packed.PagedIO) -> tuple[Live, Flow]:
    live = live_nodes(graph, io)
    seeds = {v: Kind("token", rank, axis) for v, (rank, axis) in io.seeds().items()}
    ids = io.dense_inputs.get("input_ids")
    batch = ids.shape[0] if ids is not None and ids.shape is not None and len(ids.shape) == 2 else None
    symbols = frozenset({batch.value}) if isinstance(batch, ir.SymbolicDim) and batch.value else frozenset()
    return live, analyse(live.order, seeds, _trusted(live, list(seeds), io.dense_nodes), symbols, io.dense_nodes)


def _sinks(live: Live, io: packed.PagedIO) -> list[ir.Value]:
    """Values whose kind matters: the logits, and every input of the PagedAttention nodes (the caches)."""
    out = [io.dense_outputs["logits"]] if "logits" in io.dense_outputs else []
    for node in live.order:
        if node.op_type == "PagedAttention" and node.domain == "com.microsoft":
            out += [x for x in node.inputs if x is not None]
    return out


def flow_rewrites(graph: ir.Graph, io: packed.PagedIO, b: Builder, done: list[str]) -> list[tuple[ir.Node, str]]:
    """Rewrite what the flow finds step-wide and can make per sequence; ``(node, why)`` for the rest."""
    for _ in range(_MAX_ROUNDS):
        live, flow = run_flow(graph, io)
        sinks = _sinks(live, io)
        enum_sources: set[ir.Node] = set()
        steps: dict[ir.Node, str] = {}
        for value in sinks:
            kind = flow.of(value)
            if kind.tag == "enum":
                enum_sources |= set(kind.sources)
            elif kind.tag == "route" and kind.node is not None:
                # rows regrouped and not shown put back (per_sequence.routes): other tokens' rows on a token's place
                what = f" (as {kind.role!r} of that regrouping)" if kind.role not in ("", "rows") else ""
                steps.setdefault(kind.node, f"its rows are regrouped across the step's tokens and not put back{what}")
            elif kind.tag == "step" and kind.node is not None:
                # not definite: an op without a rule, or a shape the flow cannot read (what the pipeline's shape
                # recovery could not find either); unknown is step-wide, never converted on trust
                why = kind.why or ""
                if not kind.definite:
                    lost = "" if kind.no_rule else "the flow cannot follow the token axis here; "
                    why = f"{lost}{why} (unknown is step-wide)"
                steps.setdefault(kind.node, why)
        changed = False
        for node in sorted(enum_sources, key=lambda n: n.name or ""):
            done.append(_enum_to_sequence(b, io, node, flow))
            changed = True
        for node in list(steps):
            line = _edge_token(b, io, node, flow, live) or _segment(b, io, node, flow, live)
            if line is not None:
                done.append(line)
                changed = True
                del steps[node]
        if not changed:
            return [(n, why) for n, why in steps.items() if n is not None]
    return [(n, f"still step-wide after {_MAX_ROUNDS} rounds of rewrites: {why}") for n, why in steps.items()]


def _enum_to_sequence(b: Builder, io: packed.PagedIO, node: ir.Node, flow: Flow) -> str:
    idx = packed.index_in_sequence(b, io)
    out = node.outputs[0]
    if node.op_type == "Range":
        new = idx if out.dtype in (None, ir.DataType.INT64) else b.op("Cast", [idx], {"to": out.dtype})
        what = "Range(0, tokens, 1) -> each token's index in its own sequence"
    else:  # table[0:count] along `axis` -> table rows gathered by each token's index in its sequence
        axis = flow.of(out).axis
        new = b.op("Gather", [node.inputs[0], idx], {"axis": axis}, hint="rows_per_sequence")
        what = f"rows 0..tokens of {node.inputs[0].name!r} -> each token's row by its index in its own sequence"
    out.replace_all_uses_with(new)
    return f"{describe(node)}: {what}"


def _edge_token(b: Builder, io: packed.PagedIO, node: ir.Node, flow: Flow, live: Live) -> str | None:
    """``x[:, -1:]`` / ``x[:, :1]`` broadcast back over the tokens -> each sequence's own last / first token."""
    if node.op_type != "Slice" or node.domain not in ("", "ai.onnx"):
        return None
    k = flow.of(node.inputs[0])
    if k.tag != "token" or k.rank is None:
        return None
    starts, ends = const_array(node.inputs[1]), const_array(node.inputs[2])
    axes = const_array(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
    steps = const_array(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] is not None else None
    if starts is None or ends is None or starts.size != 1 or (steps is not None and int(steps.reshape(-1)[0]) != 1):
        return None
    if (int(axes.reshape(-1)[0]) % k.rank if axes is not None else 0) != k.axis:
        return None
    start, end = int(starts.reshape(-1)[0]), int(ends.reshape(-1)[0])
    if start == -1 and end >= 2**31:
        which = "last"
    elif (start, end) == (0, 1):
        which = "first"
    else:
        return None
    out = node.outputs[0]
    if not _broadcast_back(out, k, flow, live):
        return None
    seq = packed.sequence_of_token(b, io).seq
    starts_v, ends_v = packed.sequence_bounds(b, io)
    if which == "last":
        pick = b.op("Sub", [b.op("Gather", [ends_v, seq]), b.ints([1])])
    else:
        pick = b.op("Gather", [starts_v, seq])
    new = b.op("Gather", [node.inputs[0], pick], {"axis": k.axis}, hint=f"{which}_token_per_sequence")
    new.type, new.shape = node.inputs[0].type, node.inputs[0].shape  # one row per token again: the input's shape
    io.per_token[new] = (k.rank, k.axis)
    out.replace_all_uses_with(new)
    return f"{describe(node)}: the step's {which} token -> each token's own sequence's {which} token"


def _broadcast_back(value: ir.Value, k: Kind, flow: Flow, live: Live) -> bool:
    """Every use of ``value`` goes, through element-wise ops with constants, into an element-wise op with a
    per-token value on the same axis: one row broadcast over the tokens, so each token's own row fits there."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        users = live.consumers(v)
        if not users:
            return False
        for u in users:
            if u in seen:
                continue
            seen.add(u)
            if u.op_type not in _ELEMENTWISE or u.domain not in ("", "ai.onnx"):
                return False
            others = [flow.of(x) for x in u.inputs if x is not None and x is not v]
            if any(o.tag == "token" and o.rank is not None and o.axis + (k.rank - o.rank) == k.axis for o in others):
                continue
            if any(o.tag != "const" for o in others):
                return False
            stack.extend(u.outputs)
    return True


_SEGMENT_OPS = {"ReduceSum": "zero", "ReduceMean": "zero", "ReduceMax": "lowest", "ReduceMin": "highest"}


def _segment(b: Builder, io: packed.PagedIO, node: ir.Node, flow: Flow, live: Live) -> str | None:
    """A reduction over the token axis broadcast back, or a CumSum along it -> the same over each sequence."""
    if node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "CumSum":
        return _segment_cumsum(b, io, node, flow)
    if node.op_type not in _SEGMENT_OPS:
        return None
    k = flow.of(node.inputs[0])
    dtype = node.inputs[0].dtype
    if k.tag != "token" or k.rank is None or dtype is None or not int(_attr(node, "keepdims", 1)):
        return None
    axes_arr = const_array(node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] is not None else None
    axes = [int(a) % k.rank for a in axes_arr.reshape(-1)] if axes_arr is not None else []
    if not axes or k.axis not in axes or not _broadcast_back(node.outputs[0], k, flow, live):
        return None
    x = node.inputs[0]
    others = [a for a in axes if a != k.axis]
    if others:  # one value per token first (mean of equal-sized means is the mean)
        x = b.op(node.op_type, [x, b.ints(others)], {"keepdims": 1})
    perm = [k.axis] + [i for i in range(k.rank) if i != k.axis]
    front = b.op("Transpose", [x], {"perm": perm})
    flat = b.op("Reshape", [front, b.ints([0, -1])])  # [T, F]
    onehot = packed.sequence_of_token(b, io).onehot  # [T, B]
    info = np.finfo(dtype.numpy()) if np.issubdtype(dtype.numpy(), np.floating) else np.iinfo(dtype.numpy())
    fill = {"zero": 0, "lowest": info.min, "highest": info.max}[_SEGMENT_OPS[node.op_type]]
    masked = b.op(
        "Where",
        [
            b.op("Unsqueeze", [onehot, b.ints([2])]),
            b.op("Unsqueeze", [flat, b.ints([1])]),
            b.initializer(np.array(fill, dtype.numpy()), "fill"),
        ],
    )  # [T, B, F]: each token's row in its own sequence's column only
    reduce = "ReduceSum" if node.op_type == "ReduceMean" else node.op_type
    per_seq = b.op(reduce, [masked, b.ints([0])], {"keepdims": 0})  # [B, F]
    if node.op_type == "ReduceMean":
        count = b.op("ReduceSum", [b.op("Cast", [onehot], {"to": dtype}), b.ints([0])], {"keepdims": 0})
        per_seq = b.op("Div", [per_seq, b.op("Unsqueeze", [count, b.ints([1])])])
    per_tok = b.op("Gather", [per_seq, packed.sequence_of_token(b, io).seq], {"axis": 0})  # [T, F]
    back = b.op("Reshape", [per_tok, b.op("Shape", [front])])
    inverse = [perm.index(i) for i in range(k.rank)]
    out = b.op("Transpose", [back], {"perm": inverse}, hint=f"{node.op_type}_per_sequence")
    out.type = node.outputs[0].type
    io.per_token[out] = (k.rank, k.axis)
    node.outputs[0].replace_all_uses_with(out)
    return f"{describe(node)}: {node.op_type} over the step's tokens, broadcast back -> over each token's own sequence"


def _segment_cumsum(b: Builder, io: packed.PagedIO, node: ir.Node, flow: Flow) -> str | None:
    """``CumSum`` along the token axis -> restarted at each sequence: ``cs[t] - cs_exclusive[starts[seq(t)]]``."""
    k = flow.of(node.inputs[0])
    if k.tag != "token" or k.rank is None or _attr(node, "exclusive", 0) or _attr(node, "reverse", 0):
        return None
    x, axis = node.inputs[0], node.inputs[1]
    total = b.op("CumSum", [x, axis])
    before = b.op("CumSum", [x, axis], {"exclusive": 1})  # before[t] = sum of the tokens ahead of t
    starts, _ = packed.sequence_bounds(b, io)
    first = b.op("Gather", [starts, packed.sequence_of_token(b, io).seq])  # each token's sequence's first token
    out = b.op("Sub", [total, b.op("Gather", [before, first], {"axis": k.axis})], hint="cumsum_per_sequence")
    out.type, out.shape = node.outputs[0].type, node.outputs[0].shape
    io.per_token[out] = (k.rank, k.axis)
    node.outputs[0].replace_all_uses_with(out)
    return f"{describe(node)}: CumSum along the step's tokens -> restarted at each sequence's first token"


def _attr(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)
