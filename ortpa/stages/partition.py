"""Where a paged model can be cut into pipeline stages, found by dataflow, and which nodes each stage runs.

Values fall into two kinds. *Token data* is everything computed from ``input_ids``' values (the embedding, each
layer's hidden states, its attention, the logits); ``Shape`` / ``Size`` stop it, since they read a tensor's
shape, not its values. Everything else is *index work*: positions, RoPE tables, the packed-step bookkeeping
computed from ``cumulative_sequence_lengths``, ``past_sequence_lengths``, ``block_table`` and the number of
tokens. Index work costs nothing to repeat, so every stage recomputes the index nodes it needs from the shared
inputs; only token data crosses a cut.

A cut before layer ``k`` is a token value that *dominates* what follows: every path from ``input_ids`` to layer
``k``'s PagedAttention node, to every later one and to ``logits`` passes through it, and it is computed after
layer ``k - 1``'s attention. In a pre-norm transformer that is the residual stream entering layer ``k``; of the
values that qualify, the last one (nearest layer ``k``) is taken, so layer ``k``'s own norm weights go with layer
``k``. A layer boundary no single value dominates (two residual streams, a value from an early layer read again
late) is no cut: a split that needs one is refused, with the reason. The boundary of a cut is then every token
value the later stages read from the earlier ones, by construction the dominating value plus any shape of a
hidden state (``Shape`` outputs, small int64 tensors) that later index work reads.

Stages are balanced by weight bytes (initializers their token nodes read; index work's small tables are
counted in every stage that repeats them): the cut positions minimise the largest stage (a linear partition by
dynamic programming over the layer boundaries), so MoE layers weigh what their experts weigh.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import onnx

from ortpa.errors import SplitRefused
from ortpa.ops.spec import DOMAIN, OP_TYPE
from ortpa.runtime.session import find_cache_aliases

__all__ = ["SplitPlan", "StagePart", "plan_split"]

_SHAPE_OPS = frozenset({"Shape", "Size"})
_LIGHT_BYTES = 1024  # a constant this small is a shape or an index, not a weight


@dataclass(frozen=True)
class StagePart:
    """One stage of a plan: its layers ``[first_layer, stop_layer)`` and the graph pieces it holds."""

    index: int
    first_layer: int
    stop_layer: int
    nodes: tuple[int, ...]  # indices into the source graph's nodes, in the source's (topological) order
    boundary_in: tuple[str, ...]  # token values the previous stage sends
    boundary_out: tuple[str, ...]  # token values the next stage reads
    cache_inputs: tuple[str, ...]
    cache_outputs: tuple[str, ...]
    initializers: tuple[str, ...]
    weight_bytes: int
    # (node index, cache input, this stage's cache of the same declared shape): index work that reads only the
    # shape of another stage's cache (the block size) reads one of this stage's caches instead
    shape_reads: tuple[tuple[int, str, str], ...] = ()


@dataclass(frozen=True)
class SplitPlan:
    """The stages of a split, the shared (non-cache) inputs every stage takes, and the layer each node runs."""

    stages: tuple[StagePart, ...]
    shared_inputs: tuple[str, ...]
    layers: int


def _subgraph_reads(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs (If, Loop, Scan bodies) read from the enclosing graph."""
    outer: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            defined = {i.name for i in g.input} | {i.name for i in g.initializer}
            for n in g.node:
                outer.update(x for x in (*n.input, *_subgraph_reads(n)) if x and x not in defined)
                defined.update(o for o in n.output if o)
    return outer


class _Flow:
    """The source graph as a dataflow: producers, consumers, token data."""

    def __init__(self, model: onnx.ModelProto) -> None:
        g = model.graph
        self.nodes = list(g.node)
        self.reads = [[x for x in n.input if x] + sorted(_subgraph_reads(n)) for n in self.nodes]
        self.producer: dict[str, int] = {}
        for i, n in enumerate(self.nodes):
            for o in n.output:
                if o:
                    self.producer[o] = i
        self.consumers: dict[str, list[int]] = {}
        for i, names in enumerate(self.reads):
            for x in names:
                self.consumers.setdefault(x, []).append(i)
        self.sizes = {t.name: _tensor_bytes(t) for t in g.initializer}
        token_values = {"input_ids"}
        self.token: set[int] = set()
        for i, n in enumerate(self.nodes):
            if n.op_type not in _SHAPE_OPS and any(x in token_values for x in self.reads[i]):
                self.token.add(i)
                token_values.update(o for o in n.output if o)
        # index work on input_ids itself (its packed reshape): no weight read on the way, so repeated where needed
        light: set[int] = set()
        for i in sorted(self.token):
            if all(self.sizes.get(x, 0) < _LIGHT_BYTES for x in self.reads[i]) and all(
                self.producer[x] in light
                for x in self.reads[i]
                if x in self.producer and self.producer[x] in self.token
            ):
                light.add(i)
        self.token -= light
        self.light_values = {"input_ids"} | {o for i in light for o in self.nodes[i].output if o}
        token_values = {o for i in self.token for o in self.nodes[i].output if o}
        self.token_values = token_values
        # Shape / Size of a hidden state: index work bound to the stage that has the hidden state
        self.shape_of: dict[int, int] = {
            i: self.producer[self.reads[i][0]]
            for i, n in enumerate(self.nodes)
            if n.op_type in _SHAPE_OPS and self.reads[i] and self.reads[i][0] in token_values
        }

    def token_successors(self, i: int) -> Iterator[int]:
        for o in self.nodes[i].output:
            for c in self.consumers.get(o, ()):
                if c in self.token:
                    yield c

    def reach(self, sources: Iterable[int], removed: int | None = None) -> set[int]:
        seen: set[int] = set()
        stack = [s for s in sources if s != removed]
        while stack:
            i = stack.pop()
            if i in seen:
                continue
            seen.add(i)
            stack.extend(c for c in self.token_successors(i) if c != removed)
        return seen

    def token_ancestors(self, i: int) -> set[int]:
        seen: set[int] = set()
        stack = [i]
        while stack:
            j = stack.pop()
            if j in seen:
                continue
            seen.add(j)
            stack.extend(
                self.producer[x] for x in self.reads[j] if x in self.producer and self.producer[x] in self.token
            )
        return seen


def _tensor_bytes(t: onnx.TensorProto) -> int:
    for entry in t.external_data:
        if entry.key == "length":
            return int(entry.value)
    if t.HasField("raw_data"):
        return len(t.raw_data)
    itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize if t.data_type else 1
    return math.prod(t.dims) * itemsize


def _attention_nodes(flow: _Flow) -> list[int]:
    return [i for i, n in enumerate(flow.nodes) if n.op_type == OP_TYPE and n.domain == DOMAIN]


def plan_split(
    model: onnx.ModelProto, stages: int, *, label: str = "model", first_layers: tuple[int, ...] | None = None
) -> SplitPlan:
    """Cut ``model`` (a paged model's graph; weights are not read) into ``stages`` stages; :class:`SplitRefused`
    with the reason when it cannot be cut so. ``first_layers``: each stage's first layer, chosen already (by
    :func:`ortpa.stages.place.place_layers`, before the export), instead of balancing the graph's weights."""
    flow = _Flow(model)
    layers = _attention_nodes(flow)
    if not layers:
        raise SplitRefused(label, "no PagedAttention node: split a converted (paged) model, `ortpa convert` first")
    if stages < 1 or stages > len(layers):
        raise SplitRefused(label, f"expected 1 to {len(layers)} stages (one layer at least each), got {stages}")
    if "logits" not in flow.producer or flow.producer["logits"] not in flow.token:
        raise SplitRefused(label, "expected a graph output 'logits' computed from input_ids")
    # layer k -> the node whose output dominates layers k.. and logits (None: no single value does)
    if first_layers is not None:
        return _build(
            model, flow, layers, _forced_cuts(flow, layers, first_layers, stages, label), [*first_layers, len(layers)]
        )
    cuts = {k: _cut_node(flow, layers, k) for k in range(1, len(layers))} if stages > 1 else {}
    chosen = _balance(flow, cuts, stages, label)
    return _build(model, flow, layers, [cuts[k] for k in chosen], [0, *chosen, len(layers)])  # type: ignore[misc]


def _forced_cuts(flow: _Flow, layers: list[int], first_layers: tuple[int, ...], stages: int, label: str) -> list[int]:
    """The cut node before each given stage's first layer; refused where a layer boundary has none."""
    if len(first_layers) != stages or first_layers[0] != 0 or list(first_layers) != sorted(set(first_layers)):
        raise SplitRefused(label, f"expected {stages} ascending first layers starting at 0, got {list(first_layers)}")
    if first_layers[-1] >= len(layers):
        raise SplitRefused(label, f"stage first layers {list(first_layers)} past the graph's {len(layers)} layers")
    out = []
    for k in first_layers[1:]:
        node = _cut_node(flow, layers, k)
        if node is None:
            raise SplitRefused(
                label,
                f"no single token value carries everything layer {k} and the later layers read (a second residual "
                "stream, or an early value read again later): no stage can start there",
            )
        out.append(node)
    return out


def _cut_node(flow: _Flow, layers: list[int], k: int) -> int | None:
    """The last node computed after layer ``k - 1``'s attention whose one token output every path from
    ``input_ids`` to layer ``k``, the later layers and ``logits`` passes through."""
    sources = [i for i in flow.token if any(x in flow.light_values for x in flow.reads[i])]
    later = {*layers[k:], flow.producer["logits"]}
    candidates = sorted((flow.reach([layers[k - 1]]) & flow.token_ancestors(layers[k])) - {layers[k]})
    for v in reversed(candidates):  # the nearest to layer k first: its norm weights then stay with layer k
        if len(_token_outputs(flow, v)) == 1 and not (later & flow.reach(sources, removed=v)):
            return v
    return None


def _token_outputs(flow: _Flow, i: int) -> list[str]:
    return [o for o in flow.nodes[i].output if o and o in flow.token_values and o in flow.consumers]


def _stage_of(flow: _Flow, cut_nodes: list[int]) -> dict[int, int]:
    """Token node -> stage: the number of cuts it comes after (cuts are chained: each dominates the next)."""
    stage = dict.fromkeys(flow.token, 0)
    for v in cut_nodes:
        for i in flow.reach([v]) - {v}:
            stage[i] += 1
    for i, source in flow.shape_of.items():
        stage[i] = stage[source]
    return stage


def _members(flow: _Flow, stage_of: dict[int, int], stages: int) -> list[set[int]]:
    """Each stage's nodes: its token nodes and the index work they need, recomputed from the shared inputs."""
    members = []
    for s in range(stages):
        own = {i for i, st in stage_of.items() if st == s}
        need = set(own)
        stack = list(own)
        while stack:
            j = stack.pop()
            for x in flow.reads[j]:
                p = flow.producer.get(x)
                if p is None or p in need or p in stage_of:
                    continue
                need.add(p)
                stack.append(p)
        members.append(need)
    return members


def _balance(flow: _Flow, cuts: dict[int, int | None], stages: int, label: str) -> list[int]:
    """The cut layers (ascending) that minimise the largest stage's weight bytes."""
    if stages == 1:
        return []
    usable = [k for k in sorted(cuts) if cuts[k] is not None]
    if len(usable) < stages - 1:
        blocked = [k for k in sorted(cuts) if cuts[k] is None]
        raise SplitRefused(
            label,
            f"{stages} stages need {stages - 1} cut(s) between layers, but only {len(usable)} layer boundaries are "
            f"cut by one token value: before layer(s) {blocked} no single value carries everything the later "
            "layers read (a second residual stream, or an early value read again later)",
        )
    # bytes per segment between consecutive usable cuts: the weights its nodes read, index work's included
    stage_all = _stage_of(flow, [cuts[k] for k in usable])  # type: ignore[misc]
    seg_bytes = [
        sum(flow.sizes[x] for x in {x for j in need for x in flow.reads[j] if x in flow.sizes})
        for need in _members(flow, stage_all, len(usable) + 1)
    ]
    # linear partition of the segments into `stages` contiguous groups
    n = len(seg_bytes)
    prefix = [0]
    for b in seg_bytes:
        prefix.append(prefix[-1] + b)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for s in range(1, stages + 1):
        for j in range(s, n + 1):
            for i in range(s - 1, j):
                cost = max(best[s - 1][i], prefix[j] - prefix[i])
                if cost < best[s][j]:
                    best[s][j], back[s][j] = cost, i
    bounds, j = [], n
    for s in range(stages, 0, -1):
        i = back[s][j]
        bounds.append(i)
        j = i
    starts = sorted(bounds)[1:]  # segment index where each later stage starts
    return [usable[b - 1] for b in starts]


def _build(
    model: onnx.ModelProto, flow: _Flow, layers: list[int], cut_nodes: list[int], bounds: list[int]
) -> SplitPlan:
    g = model.graph
    stages = len(bounds) - 1
    stage_of = _stage_of(flow, cut_nodes)
    aliases = find_cache_aliases(model)
    cache_in = {a.input_name for a in aliases}
    node_index = {n.name: i for i, n in enumerate(flow.nodes) if n.name}
    shared = tuple(i.name for i in g.input if i.name not in cache_in)
    outputs = [o.name for o in g.output]
    # each stage: its token nodes and the index work they need, recomputed from the shared inputs
    parts: list[StagePart] = []
    members = _members(flow, stage_of, stages)
    produced_in = {o: stage_of[i] for i in stage_of for o in flow.nodes[i].output if o}
    reads_from: list[set[str]] = [set() for _ in range(stages)]
    for s, need in enumerate(members):
        for j in need:
            for x in flow.reads[j]:
                p = produced_in.get(x)
                if p is None or p == s:
                    continue
                if p > s or p < s - 1:
                    where = flow.nodes[j].name or flow.nodes[j].op_type
                    raise SplitRefused(
                        g.name or "model",
                        f"stage {s} (node {where!r}) reads {x!r}, computed in stage {p}: only the previous stage's "
                        "values cross a cut",
                    )
                reads_from[s].add(x)
    for s, need in enumerate(members):
        caches = []
        cache_out = []
        for a in aliases:
            owner = node_index.get(a.node)
            if owner is not None and stage_of.get(owner) == s:
                caches.append(a.input_name)
                if a.output_name:
                    cache_out.append(a.output_name)
        shape_reads = _shape_reads(g, flow, need, set(caches), cache_in, g.name or "model")
        inits = sorted({x for j in need for x in flow.reads[j] if x in flow.sizes})
        bout = tuple(sorted(reads_from[s + 1])) if s + 1 < stages else ()
        if s == stages - 1 and "logits" not in {o for j in need for o in flow.nodes[j].output}:
            raise SplitRefused(g.name or "model", "the last stage does not compute 'logits'")
        missing = [o for o in outputs if o != "logits" and o not in cache_out and produced_in.get(o) == s]
        if missing:
            raise SplitRefused(g.name or "model", f"graph outputs {missing} are neither logits nor caches")
        parts.append(
            StagePart(
                index=s,
                first_layer=bounds[s],
                stop_layer=bounds[s + 1],
                nodes=tuple(sorted(need)),
                boundary_in=tuple(sorted(reads_from[s])),
                boundary_out=bout,
                cache_inputs=tuple(caches),
                cache_outputs=tuple(cache_out),
                initializers=tuple(inits),
                weight_bytes=sum(flow.sizes[x] for x in inits),
                shape_reads=shape_reads,
            )
        )
    return SplitPlan(tuple(parts), shared, len(layers))


def _shape_reads(
    g: onnx.GraphProto, flow: _Flow, need: set[int], own: set[str], caches: set[str], label: str
) -> tuple[tuple[int, str, str], ...]:
    declared = {i.name: i.type.SerializeToString() for i in g.input}
    out = []
    for j in sorted(need):
        for x in flow.reads[j]:
            if x not in caches or x in own:
                continue
            node = flow.nodes[j]
            same = [c for c in sorted(own) if declared[c] == declared[x]]
            if node.op_type not in _SHAPE_OPS or not same:
                raise SplitRefused(
                    label,
                    f"node {node.name or node.op_type!r} reads the cache {x!r} of another stage's layer"
                    + ("" if node.op_type in _SHAPE_OPS else f" ({node.op_type}, not only its shape)")
                    + ("" if same else "; this stage has no cache of the same declared shape to read instead"),
                )
            out.append((j, x, same[0]))
    return tuple(out)
