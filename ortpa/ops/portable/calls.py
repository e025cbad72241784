"""Find the caches of a file whose PagedAttention nodes were lowered to portable function calls.

A lowered node (``ortpa convert --portable``, :mod:`ortpa.deploy.portable_file`) calls a model-local function of
:data:`~ortpa.ops.portable.tracer.FUNCTION_DOMAIN` whose formal inputs are the op's schema names of the inputs it
passes (``key_cache``, ``value_cache``, ...) and whose outputs are ``output`` then the cache outputs it
produces, in schema order. So the cache inputs and their aliasing outputs are found without the op itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

from ortpa.ops.portable.tracer import FUNCTION_DOMAIN

__all__ = ["LoweredCachePort", "lowered_cache_ports", "lowered_rotary_tables"]


@dataclass(frozen=True)
class LoweredCachePort:
    """One cache a lowered call reads (``input_name``) and writes back (``output_name``, None when not exposed)."""

    input_name: str
    output_name: str | None
    node: str


def lowered_cache_ports(model: onnx.ModelProto) -> list[LoweredCachePort]:
    """The cache ports of every portable function call in ``model``'s main graph, in node order."""
    functions = {(f.domain, f.name): f for f in model.functions}
    ports: list[LoweredCachePort] = []
    for i, node in enumerate(model.graph.node):
        if node.domain != FUNCTION_DOMAIN:
            continue
        fn = functions.get((node.domain, node.op_type))
        if fn is None:
            continue
        formal = list(fn.input)
        outs = list(node.output)
        for k, kind in enumerate(("key_cache", "value_cache"), start=1):
            if kind not in formal:
                continue
            name = node.input[formal.index(kind)]
            if not name:
                continue
            # the outputs are "output" then key_cache_out / value_cache_out when produced: with both caches
            # read, output k is cache k; a node reading only the key cache (LATENT) has it at position 1
            pos = k if "value_cache" in formal else 1
            out = outs[pos] if len(outs) > pos and outs[pos] else None
            ports.append(LoweredCachePort(name, out, node.name or f"{node.op_type}_{i}"))
    return ports


def lowered_rotary_tables(model: onnx.ModelProto) -> list[tuple[str, str]]:
    """``(cos_cache, sin_cache)`` input names of every portable call that rotates in the op (``do_rotary=1``)."""
    functions = {(f.domain, f.name): f for f in model.functions}
    tables = []
    for node in model.graph.node:
        fn = functions.get((node.domain, node.op_type)) if node.domain == FUNCTION_DOMAIN else None
        if fn is None or "cos_cache" not in fn.input or "sin_cache" not in fn.input:
            continue
        formal = list(fn.input)
        tables.append((node.input[formal.index("cos_cache")], node.input[formal.index("sin_cache")]))
    return tables
