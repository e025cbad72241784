"""Recognisers: each source form of MHA / GQA attention -> one :class:`AttentionLayer` description.

A layer is handed to the recogniser of the op that reads its key cache: ``com.microsoft::GroupQueryAttention``
(:mod:`.gqa`), ``com.microsoft::MultiHeadAttention`` (:mod:`.mha`), or the decomposed / SDPA / ONNX ``Attention``
forms of torch exports, dynamo and TorchScript-era alike (:mod:`ortpa.rewriter.recognisers.decomposed`). Every
recogniser returns the same description, which one emitter
(:func:`ortpa.rewriter.attention.rewrite_attention_layer`) turns into PagedAttention ``SEPARATE``; a layer it
cannot describe becomes a :class:`LayerFailure` with the reason. MLA layers have their own recogniser and
description (:mod:`ortpa.rewriter.recognisers.mla`). Adding a form is adding a module here and a line to
``RECOGNISERS``.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx_ir as ir

from ortpa.rewriter.layer import AttentionLayer, LayerFailure
from ortpa.rewriter.recognisers import gqa, mha
from ortpa.rewriter.recognisers._match import cache_layers, graph_input, match_or_failure
from ortpa.rewriter.recognisers.decomposed import recognise_decomposed

__all__ = ["RECOGNISERS", "recognise_separate_layers", "source_op"]

Recogniser = Callable[[ir.Graph, int], AttentionLayer]

# (op reading the key cache, recogniser); None = the decomposed forms (Concat of past and new keys)
RECOGNISERS: tuple[tuple[str | None, Recogniser], ...] = (
    (gqa.OP_TYPE, gqa.recognise_gqa),
    (mha.OP_TYPE, mha.recognise_mha),
    (None, recognise_decomposed),
)


def source_op(graph: ir.Graph, layer: int) -> str | None:
    """The ``com.microsoft`` attention op reading layer ``layer``'s key cache, if any."""
    past_k = graph_input(graph, f"past_key_values.{layer}.key")
    if past_k is None:
        return None
    for node in past_k.consumers():
        if node.domain == "com.microsoft" and any(node.op_type == op for op, _ in RECOGNISERS if op):
            return node.op_type
    # the builder's fp16 form appends to the cache first and reaches MultiHeadAttention through repeat_kv
    return mha.OP_TYPE if mha.forward_op(past_k, mha.OP_TYPE) is not None else None


def recognise_separate_layers(graph: ir.Graph) -> list[AttentionLayer | LayerFailure]:
    """Describe every layer that has ``past_key_values.{i}.key`` inputs, in layer order."""
    by_op = dict(RECOGNISERS)
    return [match_or_failure(by_op[source_op(graph, i)], graph, i) for i in cache_layers(graph)]
