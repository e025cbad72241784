"""Cache I/O found by what reads and writes it, then given the names the rest of the rewriter uses.

Exporters name their KV caches differently (``past_key_values.{i}.key`` for torch dynamo, optimum and the
onnxruntime-genai builder; ``input.cache.layers.{i}.keys`` / ``output.cache.layers.{i}.keys`` for transformers
5.x's ``OnnxExporter``), and some write fixed dims as digit strings (``dim_param: "2"``). A cache is a rank-4
float graph input that a ``Concat(past, new, axis=2)`` extends into a graph output; it is a *value* cache when
the extended tensor is what the attention probabilities multiply (``MatMul(Softmax(...), v)``) and a *key*
cache when it reaches the Softmax through the scores; a key and a value cache reaching the same Softmax belong
to one layer, and layers are numbered in graph order. :func:`canonicalise_cache_io` renames them to
``past_key_values.{i}.key`` / ``.value`` and ``present.{i}.key`` / ``.value``, so one set of recognisers and one
emitter serve every exporter; a model that already uses those names is left as it is.
"""

from __future__ import annotations

import re
from collections import deque

import onnx_ir as ir

from ortpa.rewriter._graph import int_attr
from ortpa.rewriter.recognisers._match import softmax_of

__all__ = ["canonicalise_cache_io", "numeric_dims"]


def numeric_dims(graph: ir.Graph) -> int:
    """Digit-string symbolic dims of the graph's inputs and outputs -> numbers; how many were changed."""
    changed = 0
    for value in [*graph.inputs, *graph.outputs]:
        if value.shape is None:
            continue
        dims = list(value.shape)
        fixed = [int(str(d)) if not isinstance(d, int) and str(d).isdigit() else d for d in dims]
        if fixed != dims:
            changed += sum(1 for a, b in zip(dims, fixed, strict=True) if a is not b)
            value.shape = ir.Shape(fixed)
    return changed


def _extending_concat(past: ir.Value, outputs: set[ir.Value]) -> ir.Value | None:
    for node in past.consumers():
        if (
            node.op_type == "Concat"
            and len(node.inputs) == 2
            and node.inputs[0] is past
            and int_attr(node, "axis") in (2, -2)
            and node.outputs[0] in outputs
        ):
            return node.outputs[0]
    return None


def _role(present: ir.Value, max_nodes: int = 120) -> tuple[str, ir.Node] | None:
    """('key' | 'value' | 'latent', the Softmax it serves), walking forward from the extended cache to the
    attention it feeds and no further. ``latent``: the cache reaches one Softmax both through the scores and as
    what its probabilities multiply (dense MLA's compressed KV, expanded into keys and values by ``kv_b_proj``)."""
    seen: set[int] = set()
    queue = deque([present])
    as_key: ir.Node | None = None
    as_value: ir.Node | None = None
    while queue and len(seen) < max_nodes:
        value = queue.popleft()
        for node in value.consumers():
            if id(node) in seen:
                continue
            seen.add(id(node))
            if node.op_type == "MatMul" and node.inputs[1] is value:
                softmax = softmax_of(node.inputs[0])
                if softmax is not None:
                    as_value = as_value or softmax
                    continue  # the attention's output: past it lies the next layer
            if node.op_type == "Softmax":
                as_key = as_key or node
                continue
            queue.extend(node.outputs)
    if as_key is not None and as_value is not None:
        return ("latent", as_key) if as_key is as_value else ("value", as_value)
    if as_value is not None:
        return "value", as_value
    return ("key", as_key) if as_key is not None else None


def _name_hint(name: str) -> tuple[int, str] | None:
    """(layer, 'key' | 'value') from an exporter's cache name, e.g. ``input.cache.layers.3.keys``."""
    m = re.search(r"(\d+)\D*?(key|value)s?$", name)
    return (int(m[1]), m[2]) if m else None


def canonicalise_cache_io(graph: ir.Graph) -> list[str]:
    """Rename structurally found caches to ``past_key_values.{i}.*`` / ``present.{i}.*``; notes on what changed.

    Caches whose role the structure does not show (an attention the recognisers will then refuse, say one
    without a Softmax) fall back to the layer number and key / value word in their names, so the layer is
    still reported by its recogniser with the reason instead of disappearing from the model's layers.
    """
    notes = []
    if numeric_dims(graph):
        notes.append("digit-string dims read as numbers")
    if any((v.name or "").startswith("past_key_values.") for v in graph.inputs):
        return notes
    outputs = set(graph.outputs)
    order = {id(node): i for i, node in enumerate(graph)}
    found: list[tuple[ir.Value, ir.Value, str | None, int | None]] = []  # past, present, kind, softmax order
    for past in graph.inputs:
        if past.shape is None or len(past.shape) != 4:
            continue
        present = _extending_concat(past, outputs)
        if present is None:
            continue
        role = _role(present)
        found.append((past, present, role[0] if role else None, order.get(id(role[1])) if role else None))
    if not found:
        return notes
    # dense MLA: the latent is the layer's key cache (one latent head, as the MLA recogniser reads it), the
    # cache of the roped key part that reaches the same Softmax only through the scores its value cache
    latent_at = {o for _, _, kind, o in found if kind == "latent"}
    found = [
        (past, present, "key" if kind == "latent" else "value" if kind == "key" and o in latent_at else kind, o)
        for past, present, kind, o in found
    ]
    hints = [_name_hint(past.name or "") for past, *_ in found]
    if all(h is not None for h in hints):  # the exporter numbers its layers: keep its numbers
        layer_of = [h[0] for h in hints if h is not None]
        kinds = [kind or h[1] for (_, _, kind, _), h in zip(found, hints, strict=True) if h is not None]
    else:  # number layers by where their attention sits in the graph
        softmax_orders = sorted({o for *_, o in found if o is not None})
        layer_of = [softmax_orders.index(o) if o is not None else -1 for *_, o in found]
        kinds = [kind or "" for _, _, kind, _ in found]
    for (past, present, _, _), layer, kind in zip(found, layer_of, kinds, strict=True):
        if layer < 0 or kind not in ("key", "value"):
            continue
        old = past.name
        past.name, present.name = f"past_key_values.{layer}.{kind}", f"present.{layer}.{kind}"
        notes.append(f"cache {old} -> {past.name}")
    return notes
