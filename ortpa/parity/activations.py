"""Float32 activations for an original that quantizes them to int8, and for its conversion.

onnxruntime-genai's int4 builds run their projections as ``com.microsoft::MatMulNBits`` with
``accuracy_level=4``: each activation row is quantized to int8 before the product. One int8 step is 1/127 of a
block's largest value, so a value the conversion rounds to its half cache moves an activation across a step now
and then, and the logits by about a tenth of a nat: nothing the conversion's structure did, and large enough to
hide a structural mistake. ``accuracy_level`` 0 computes the same int4 weights, dequantized, with float32
activations: set on both sides (header-only), the two differ by reordered float32 sums and are compared at the
float32 structure bound, as every other original's twin is. Dynamic quantization (``MatMulInteger`` and kin) has
no such switch: those originals keep being judged at int8's bound.
"""

from __future__ import annotations

import onnx

__all__ = ["INT8_ACTIVATION_OPS", "int8_activation_matmuls", "switch_to_float32_activations"]

# ops that quantize activations to int8 with no attribute to turn it off
INT8_ACTIVATION_OPS = ("DynamicQuantizeLinear", "DynamicQuantizeMatMul", "MatMulInteger")
_FLOAT32_ACTIVATIONS = 0  # MatMulNBits accuracy_level: the activations' own type


def int8_activation_matmuls(proto: onnx.ModelProto) -> list[onnx.NodeProto]:
    """``proto``'s MatMulNBits nodes that quantize their activations to int8 (``accuracy_level=4``)."""
    return [
        n
        for n in proto.graph.node
        if n.op_type == "MatMulNBits" and any(a.name == "accuracy_level" and a.i == 4 for a in n.attribute)
    ]


def switch_to_float32_activations(*protos: onnx.ModelProto) -> bool:
    """Set ``accuracy_level`` 0 on every int8-activation MatMulNBits of each of ``protos`` (in place) and return
    True; or change nothing and return False where any of them quantizes activations otherwise
    (:data:`INT8_ACTIVATION_OPS`) or not at all."""
    found = [int8_activation_matmuls(p) for p in protos]
    if not all(found) or any(n.op_type in INT8_ACTIVATION_OPS for p in protos for n in p.graph.node):
        return False
    for nodes in found:
        for node in nodes:
            for a in node.attribute:
                if a.name == "accuracy_level":
                    a.i = _FLOAT32_ACTIVATIONS
    return True
