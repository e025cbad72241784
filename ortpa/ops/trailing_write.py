"""A PagedAttention node whose cache output gets more rows from the graph before it leaves the graph.

The expanded MLA prefill (:mod:`ortpa.rewriter.mla_expanded`) writes the fresh prompts' latent rows with one
``ScatterND`` on the LATENT node's ``key_cache_out``; that ``ScatterND``'s output is the graph's cache output.
Each backend needs the cache graph input written in place, by one writer reading it:

* portable: :func:`trailing_writes` finds the pattern; the lowering folds the rows into the layer function's
  own ``ScatterND`` (``PortableConfig.extra_write``);
* native (CUDA demands that ``key_cache_out`` is its input's buffer): :func:`write_before_native` moves the
  ``ScatterND`` before the node, which then reads the written cache and updates it through its input.
"""

from __future__ import annotations

from collections.abc import Collection

import onnx

from ortpa.ops.spec import DOMAIN, OP_TYPE

__all__ = ["trailing_writes", "write_before_native"]


def trailing_writes(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    """PagedAttention nodes (by the name of their ``key_cache_out``) whose ``key_cache_out`` is read only by a
    ``ScatterND`` (its data input, no reduction) that produces a graph output: that write is folded into the
    node's own, so that the cache graph input is still written once, by the ScatterND reading it (in place when
    IO-bound)."""
    readers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    outputs = {o.name for o in graph.output}
    found = {}
    for node in graph.node:
        if node.op_type != OP_TYPE or node.domain != DOMAIN or len(node.output) < 2 or not node.output[1]:
            continue
        users = readers.get(node.output[1], [])
        if len(users) != 1 or node.output[1] in outputs:
            continue
        sc = users[0]
        reduction = next((a.s for a in sc.attribute if a.name == "reduction"), b"none")
        if (
            sc.op_type == "ScatterND"
            and sc.domain in ("", "ai.onnx")
            and list(sc.input).index(node.output[1]) == 0
            and list(sc.input).count(node.output[1]) == 1
            and reduction in (b"none", "none")
            and sc.output[0] in outputs
        ):
            found[node.output[1]] = sc
    return found


def write_before_native(model: onnx.ModelProto, node_names: Collection[str]) -> onnx.ModelProto:
    """A copy of ``model`` where each named (natively run) PagedAttention node with a trailing write
    (:func:`trailing_writes`) comes after it instead: the ``ScatterND`` reads the cache graph input and writes
    the graph output (in place when both are bound to one buffer: CUDA's ScatterND skips its copy then), and the
    node reads that output as its ``key_cache`` with no ``key_cache_out`` (a native kernel updates the cache
    through its input). The CUDA kernel refuses a ``key_cache_out`` that is not its input's buffer, which an
    intermediate value would be. The two writes touch different sequences' slots, and the node reads none of
    the fresh ones: the order does not change what is stored or attended."""
    folded = trailing_writes(model.graph)
    wanted = set(node_names)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    by_output = {n.output[1]: n for n in out.graph.node if n.op_type == OP_TYPE and len(n.output) > 1}
    moved: dict[str, onnx.NodeProto] = {}  # PagedAttention key_cache_out -> its ScatterND, to move before it
    for cache_out, _ in folded.items():
        node = by_output.get(cache_out)
        if node is not None and node.name in wanted:
            moved[cache_out] = node
    if not moved:
        return out
    nodes: list[onnx.NodeProto] = []
    scatters = {n.input[0]: n for n in out.graph.node if n.op_type == "ScatterND" and n.input and n.input[0] in moved}
    moved_outputs = {sc.output[0] for sc in scatters.values()}
    for node in out.graph.node:
        if node.op_type == "ScatterND" and node.output[0] in moved_outputs:
            continue
        if node.op_type == OP_TYPE and len(node.output) > 1 and node.output[1] in moved:
            sc = onnx.NodeProto()
            sc.CopyFrom(scatters[node.output[1]])
            sc.input[0] = node.input[3]
            node.input[3] = sc.output[0]
            del node.output[1:]
            nodes.append(sc)
        nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out
