"""Whole-model float32 -> float16/bfloat16: initializers, constants, Casts, graph I/O and value types.

A plain cast of the graph: it does not keep sensitive ops (norms, softmax) in float32. For best accuracy
export the model in the target precision instead; this exists so a float32 export can run on the op, whose
activations must be float16 or bfloat16.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["convert_float_type"]

_FLOAT = ir.DataType.FLOAT


def _cast_tensor(tensor: ir.TensorProtocol, target: ir.DataType) -> ir.TensorProtocol:
    """The cast, computed when the tensor is written (lazily, one tensor at a time): casting every weight up
    front would hold the whole converted model in memory at once."""

    def cast() -> ir.Tensor:
        return ir.tensor(tensor.numpy().astype(target.numpy()), name=tensor.name)

    return ir.LazyTensor(cast, dtype=target, shape=tensor.shape, name=tensor.name)


def convert_float_type(model: ir.Model, target: ir.DataType) -> None:
    """In place: every float32 tensor, attribute and type in the main graph becomes ``target``."""
    graph = model.graph
    for value in graph.initializers.values():
        if value.const_value is not None and value.const_value.dtype == _FLOAT:
            value.const_value = _cast_tensor(value.const_value, target)
    for node in graph:
        if node.op_type == "Cast" and node.attributes.get("to") is not None:
            if node.attributes["to"].value == _FLOAT:
                node.attributes["to"] = ir.AttrInt64("to", target)
        for name in ("value", "value_float"):
            attr = node.attributes.get(name)
            if attr is not None and attr.type == ir.AttributeType.TENSOR and attr.value.dtype == _FLOAT:
                node.attributes[name] = ir.AttrTensor(name, _cast_tensor(attr.value, target))
        if node.op_type == "ConstantOfShape" and node.attributes.get("value") is not None:
            pass  # handled above (tensor attribute)
        for out in node.outputs:
            if out.dtype == _FLOAT:
                out.type = ir.TensorType(target)
    for value in [*graph.inputs, *graph.outputs, *graph.initializers.values()]:
        if value.dtype == _FLOAT:
            value.type = ir.TensorType(target)
