"""A converted model as it was before the ``logits_indices`` input: its rows per sequence only (the baseline that
prompt scoring in one pass is measured and checked against)."""

from __future__ import annotations

import onnx

__all__ = ["without_logits_indices"]


def without_logits_indices(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with ``logits_indices`` no longer an input: its empty default becomes a constant, so every step
    computes each sequence's last row, and a runtime scores a prompt one token per step. Graph only; the caller's
    proto is not modified."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    kept = [i for i in out.graph.input if i.name != "logits_indices"]
    if len(kept) == len(out.graph.input):
        raise ValueError("expected a converted model with a logits_indices input; found none")
    if not any(init.name == "logits_indices" for init in out.graph.initializer):
        raise ValueError("expected logits_indices to have its default (an initializer of the same name)")
    del out.graph.input[:]
    out.graph.input.extend(kept)
    return out
