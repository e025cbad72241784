"""Weights stored as ``com.microsoft::MatMulNBits`` (onnxruntime-genai int4, ORT's weight-only quantizer).

The rewrite leaves every quantized projection it does not need to change as it is. MLA absorption is the one
place that needs a weight's values: ``kv_b_proj`` is split into ``W_UK`` (absorbed into the query path) and
``W_UV`` (applied to the op's output). A quantized ``kv_b_proj`` is dequantized exactly as the op does it,
``(q - zero_point) * scale`` per block of ``block_size`` input channels, and absorbed in floating point; the
absorbed matrices are *not* re-quantized, since their rows mix all of a head's quantization blocks and a second
rounding would add error the source model does not have. They stay as per-head MatMuls (``absorb="matmul"``),
because the quantized ``q_proj`` / ``o_proj`` they would otherwise fold into are kept as they are. The cost is
memory: ``kv_b_proj``'s ``L x H*(P+V)`` values in the op's float type instead of 4 bits (for DeepSeek-V3,
32 MB per layer in fp16 instead of 8 MB).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortpa.rewriter._graph import const_array, int_attr

__all__ = ["OP_TYPE", "dequantized_weight", "is_matmul_nbits"]

OP_TYPE = "MatMulNBits"


def is_matmul_nbits(node: ir.Node) -> bool:
    return node.op_type == OP_TYPE and node.domain == "com.microsoft"


def _unpack(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Little-endian bit fields of ``bits`` bits from uint8 bytes (last axis), the first ``count`` of them."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    fields = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
    return fields.reshape(*packed.shape[:-1], -1)[..., :count]


def dequantized_weight(node: ir.Node) -> np.ndarray | None:
    """The ``[K, N]`` float32 weight a MatMulNBits node multiplies by (ONNX MatMul layout), or None when its
    quantized data are not constants or use a feature read here (``g_idx``, bits other than 2/4/8, a bias)."""
    k, n = int_attr(node, "K"), int_attr(node, "N")
    bits, block = int_attr(node, "bits", 4), int_attr(node, "block_size")
    if k is None or n is None or block is None or bits not in (2, 4, 8):
        return None
    inputs = list(node.inputs) + [None] * (6 - len(node.inputs))
    if inputs[4] is not None or inputs[5] is not None:  # g_idx (act-order) / bias
        return None
    packed, scales = const_array(inputs[1]), const_array(inputs[2])
    if packed is None or scales is None:
        return None
    blocks = -(-k // block)
    q = _unpack(packed.reshape(n, blocks, -1).astype(np.uint8), bits, block).astype(np.float32)  # [N, blocks, block]
    scale = scales.astype(np.float32).reshape(n, blocks, 1)
    zp_in = const_array(inputs[3]) if inputs[3] is not None else None
    if inputs[3] is not None and zp_in is None:
        return None
    if zp_in is None:
        zero = np.float32(1 << (bits - 1))
    elif zp_in.dtype == np.uint8:  # packed like the weights, per row of blocks
        zero = _unpack(zp_in.reshape(n, -1), bits, blocks).astype(np.float32).reshape(n, blocks, 1)
    else:  # same type as the scales: the zero point as a float value
        zero = zp_in.astype(np.float32).reshape(n, blocks, 1)
    weight = ((q - zero) * scale).reshape(n, blocks * block)[:, :k]
    return np.ascontiguousarray(weight.T)
