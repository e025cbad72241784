"""Which side of the conversion a model file is on: dense, paged (PagedAttention nodes) or lowered (``--portable``).

Commands that take one kind and are given the other say so in their own words ("already paged", "convert it
first") instead of failing later on an input list or a kernel's type error. Decided from the graph's header only:
the op, ortpa's metadata and the paged interface's ``block_table`` input, never from names of the dense caches.
"""

from __future__ import annotations

import enum

import onnx
import onnx_ir as ir

__all__ = ["PORTABLE_METADATA_KEY", "ModelKind", "model_kind"]

PORTABLE_METADATA_KEY = "ortpa.portable"  # written by ``convert --portable`` (ortpa.deploy.portable_file)


class ModelKind(enum.Enum):
    DENSE = "dense"  # past/present KV (or none): what ``ortpa convert`` takes
    PAGED = "paged"  # com.microsoft::PagedAttention nodes over paged caches
    PORTABLE = "portable"  # paged, with every PagedAttention node lowered to standard ONNX ops


def model_kind(model: onnx.ModelProto | ir.Model) -> ModelKind:
    """The kind of ``model`` (its graph header is enough: external data is never read)."""
    if isinstance(model, onnx.ModelProto):
        keys = {p.key for p in model.metadata_props}
        ops = {(n.domain, n.op_type) for n in model.graph.node}
        inputs = {i.name for i in model.graph.input}
    else:
        keys = set(model.metadata_props)
        ops = {(n.domain, n.op_type) for n in model.graph}
        inputs = {v.name for v in model.graph.inputs}
    if PORTABLE_METADATA_KEY in keys:
        return ModelKind.PORTABLE
    if ("com.microsoft", "PagedAttention") in ops or "block_table" in inputs:  # "block_table": the paged interface
        return ModelKind.PAGED
    return ModelKind.DENSE
