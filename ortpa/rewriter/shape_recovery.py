"""Shapes for the values the onnxscript optimizer leaves without one, before the rewrite.

The optimizer infers shapes node by node with onnx's own rules, so past the first node onnx has no schema for
(``com.microsoft`` ops: genai's ``SkipSimplifiedLayerNormalization``, ``GroupQueryAttention``, ``MoE``...) every value
of a model exported without ``value_info`` (the usual case past 2 GB, where the exporter cannot run shape inference
on one proto) is left without a shape. The per-sequence dataflow (:mod:`ortpa.rewriter.per_sequence.flow`) reads
ranks and dims from shapes, and refuses what it cannot follow; :func:`recover_shapes` gives it the shapes back.

ONNX Runtime's symbolic shape inference (which knows the contrib ops), then onnx's, run on the graph with every
initializer of :data:`MIN_BYTES` or more declared as a typed graph input instead: no weight is read or copied, so
the cost is one graph-sized protobuf whatever the model's size. Only values without a shape get one; what neither
inference finds stays unknown (and the flow refuses it where it matters).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import onnx
import onnx_ir as ir

__all__ = ["MIN_BYTES", "recover_shapes", "weightless_proto"]

MIN_BYTES = 4096  # initializers from this size up are typed graph inputs in the proto inference reads

_log = logging.getLogger(__name__)


def _nbytes(tensor: ir.TensorProtocol) -> int:
    return math.ceil(math.prod(tensor.shape.numpy()) * tensor.dtype.itemsize)


def weightless_proto(irm: ir.Model, min_bytes: int = MIN_BYTES) -> onnx.ModelProto:
    """``irm`` serialized with its initializers of ``min_bytes`` or more as typed graph inputs (never read)."""
    graph = irm.graph
    held = {
        name: value.const_value
        for name, value in graph.initializers.items()
        if value.const_value is not None and _nbytes(value.const_value) >= min_bytes
    }
    stub = ir.Tensor(np.zeros(0, np.uint8))  # serialized in the weights' place, then dropped
    try:
        for name in held:
            graph.initializers[name].const_value = stub
        proto = ir.serde.serialize_model(irm)
    finally:
        for name, tensor in held.items():
            graph.initializers[name].const_value = tensor
    kept = [t for t in proto.graph.initializer if t.name not in held]
    infos = [v for v in proto.graph.value_info if v.name not in held]
    del proto.graph.initializer[:], proto.graph.value_info[:]
    proto.graph.initializer.extend(kept)
    proto.graph.value_info.extend(infos)
    inputs = {i.name for i in proto.graph.input}
    for name, tensor in held.items():
        if name not in inputs:
            dims = [int(d) for d in tensor.shape.numpy()]
            proto.graph.input.append(onnx.helper.make_tensor_value_info(name, tensor.dtype.value, dims))
    return proto


def _inferred_types(proto: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Value name -> inferred type with a shape: ONNX Runtime's symbolic inference first, onnx's for the rest.

    Each is best effort (symbolic inference stops at an op it cannot follow, onnx's at contrib ops): what either
    cannot tell is simply not returned."""
    from ortpa.ops.shape_inference import infer_shapes

    def symbolic() -> onnx.ModelProto:
        from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference  # needs sympy (a dependency)

        return SymbolicShapeInference.infer_shapes(proto, auto_merge=True)

    found: dict[str, onnx.TypeProto] = {}
    runs = (symbolic, lambda: infer_shapes(proto))
    for run in runs:
        try:
            inferred = run()
        except Exception as exc:  # an inference that fails leaves the shapes unknown, never the conversion
            _log.debug("shape inference failed: %s", exc)
            continue
        for info in [*inferred.graph.value_info, *inferred.graph.output]:
            tensor = info.type.tensor_type
            if info.type.HasField("tensor_type") and tensor.HasField("shape") and info.name not in found:
                found[info.name] = info.type
    return found


def _unknown_dims(shape: ir.Shape | None) -> bool:
    """No shape, or a dim that is neither a number nor a named symbol (what TorchScript-era exports leave after
    reshapes to targets read with ``Shape``: optimum's ``[None, None, None, None]``)."""
    if shape is None:
        return True
    return any(not isinstance(d, int) and (not isinstance(d, ir.SymbolicDim) or not d.value) for d in shape)


def _merged(old: ir.Shape | None, new: ir.Shape | None, symbols: set[str]) -> ir.Shape | None:
    """``new`` where ``old`` is missing; else ``old`` with its unknown dims filled from ``new`` (same rank) where
    ``new`` has a number or one of the graph inputs' symbols (never a symbol inference made up: the flow reads
    the token axis from the symbols)."""
    if old is None or new is None:
        return new if old is None else old
    if len(old) != len(new):
        return old

    def fill(o, n):
        if not _unknown_dims(ir.Shape([o])):
            return o
        return n if isinstance(n, int) or (isinstance(n, ir.SymbolicDim) and n.value in symbols) else o

    return ir.Shape([fill(o, n) for o, n in zip(old, new, strict=True)])


def recover_shapes(irm: ir.Model) -> int:
    """Give every value of ``irm``'s main graph that has no shape, or unknown dims, what shape inference finds;
    returns how many values got a shape or a dim. Called by the pipeline after the optimizer, before any layer is
    matched."""
    missing = [o for node in irm.graph for o in node.outputs if o.name and _unknown_dims(o.shape)]
    if not missing:
        return 0
    found = _inferred_types(weightless_proto(irm))
    symbols = {
        d.value for v in irm.graph.inputs if v.shape is not None for d in v.shape if isinstance(d, ir.SymbolicDim)
    }
    count = 0
    for value in missing:
        type_proto = found.get(value.name)
        if type_proto is None:
            continue
        before = value.shape
        value.shape = _merged(before, ir.serde.deserialize_type_proto_for_shape(type_proto), symbols)
        if value.type is None:
            value.type = ir.serde.deserialize_type_proto_for_type(type_proto)
        count += value.shape is not None and (before is None or list(value.shape) != list(before))
    return count
