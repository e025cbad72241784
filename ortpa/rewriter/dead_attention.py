"""Attention ops whose output reaches no graph output, kept alive through the pre-optimisation.

An export can write a layer's cache (``present.{i}.*``) while that layer's attention output reaches nothing.
onnxruntime-genai 0.18's builder does so when a Linear inside a decoder layer has ``vocab_size`` outputs: it
takes any such module for the LM head (``has_lm_head``), so with Phi-3's fused ``gate_up_proj``
(``2 * intermediate_size == vocab_size``) the logits read layer 0's post-attention norm and every later layer only
appends to its cache. The model computes exactly that, and its greedy tokens are what a conversion must give.

With ``GroupQueryAttention`` the op writes ``present`` itself and stays in the graph. With the builder's fp16
form (an explicit cache ``Concat``, then ``MultiHeadAttention``) the optimizer's dead-code pass removes the op and
its query path, and the layer is left as a ``Concat`` whose head size nothing states. :func:`pin` makes such an op's
output a graph output before the optimizer runs, so the layer is recognised and rewritten like the others (its
PagedAttention writes the cache as the source's ``Concat`` did); :func:`unpin` drops those outputs once the
layers are matched, and the dense remains go with the rest.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["PINNED_OPS", "pin", "unpin"]

# contrib attention ops whose output can be dead while the layer's cache is still written
PINNED_OPS = ("MultiHeadAttention",)


def _live_nodes(graph: ir.Graph) -> set[int]:
    """Ids of the nodes some graph output depends on (through subgraph captures too)."""
    live: set[int] = set()
    stack = [v for v in graph.outputs]
    while stack:
        node = stack.pop().producer()
        if node is None or id(node) in live:
            continue
        live.add(id(node))
        stack.extend(v for v in node.inputs if v is not None)
        for attr in node.attributes.values():
            subgraphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else []
            subgraphs += list(attr.value) if attr.type == ir.AttributeType.GRAPHS else []
            for sub in subgraphs:
                stack.extend(v for inner in ir.traversal.RecursiveGraphIterator(sub) for v in inner.inputs if v)
    return live


def pin(graph: ir.Graph) -> list[ir.Value]:
    """Append the output of every :data:`PINNED_OPS` node that reaches no graph output to the graph's outputs;
    the values appended (for :func:`unpin`)."""
    live = _live_nodes(graph)
    pinned = [
        node.outputs[0]
        for node in graph
        if node.domain == "com.microsoft" and node.op_type in PINNED_OPS and id(node) not in live and node.outputs
    ]
    graph.outputs.extend(pinned)
    return pinned


def unpin(graph: ir.Graph, pinned: list[ir.Value]) -> None:
    """Remove the values :func:`pin` appended from the graph's outputs (once the layers are matched: the op
    stays in the graph until the rewrite replaces it and the final dead-code pass removes what is left)."""
    ids = {id(v) for v in pinned}
    for value in [v for v in graph.outputs if id(v) in ids]:
        graph.outputs.remove(value)
