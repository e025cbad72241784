"""The model's own RoPE as cos/sin caches for PagedAttention's ``do_rotary=1``.

Rather than re-deriving a RoPE variant (default, YaRN, LongRoPE, dynamic NTK, attention factors) from a config
the ONNX file does not carry, the graph's own cos/sin subgraph (``position_ids -> ... -> Cos/Sin [-> scale]``)
is extracted and run by ONNX Runtime for positions ``0 .. rows-1``. transformers builds ``cat(freqs, freqs)``,
so the op's ``[rows, R/2]`` caches are the first halves (checked).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ortpa.errors import ConversionError
from ortpa.providers import CPU
from ortpa.rewriter._graph import consumers, scalar
from ortpa.rewriter.per_sequence import TOKEN_REDUCTIONS

__all__ = ["rope_caches"]


def _follow_scale(value: ir.Value) -> ir.Value:
    """Through ``* attention_scaling`` / Cast, as long as the chain does not branch."""
    while True:
        users = consumers(value)
        if len(users) != 1 or users[0].op_type not in ("Mul", "Div", "Cast"):
            return value
        node = users[0]
        if node.op_type != "Cast" and scalar(node.inputs[1]) is None and scalar(node.inputs[0]) is None:
            return value
        value = node.outputs[0]


def _trig(graph: ir.Graph, op_type: str, width: int) -> ir.Value:
    found = [
        _follow_scale(n.outputs[0])
        for n in graph
        if n.op_type == op_type and n.outputs[0].shape is not None and n.outputs[0].shape[-1] == width
    ]
    if len(found) != 1:
        raise ConversionError(
            "cannot move RoPE into the op: the model's cos/sin tables were not found",
            [("graph", f"expected one {op_type} node of width {width}, found {len(found)}")],
        )
    return found[0]


def rope_caches(model: ir.Model, rope_dim: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)`` float32 ``[rows, rope_dim/2]`` evaluated from ``model``'s own RoPE subgraph."""
    import onnxruntime as ort

    graph = model.graph
    width = rope_dim
    widths = {n.outputs[0].shape[-1] for n in graph if n.op_type == "Cos" and n.outputs[0].shape is not None}
    if width not in widths:
        # ONNX RotaryEmbedding (opset-23 exports) reads half-width tables: cos(freqs), not cos(cat(freqs, freqs))
        width = rope_dim // 2
    cos_v, sin_v = _trig(graph, "Cos", width), _trig(graph, "Sin", width)
    try:
        sub = ir.convenience.extract(graph, inputs=["position_ids"], outputs=[cos_v, sin_v])
    except ValueError as exc:
        raise ConversionError(
            "cannot move RoPE into the op", [("graph", f"cos/sin do not depend on position_ids alone: {exc}")]
        ) from exc
    reductions = sorted({n.op_type for n in sub if n.op_type in TOKEN_REDUCTIONS})
    if reductions:
        # e.g. LongRoPE: long or short factors picked from max(position_ids) + 1. A table evaluated for positions
        # 0..rows-1 in one run would give every sequence the factors of the longest one.
        raise ConversionError(
            "cannot move RoPE into the op",
            [
                (
                    "graph",
                    f"cos/sin depend on a reduction over positions ({', '.join(reductions)}): the table "
                    "depends on each sequence's length (LongRoPE); keep RoPE in the graph (rope_in_op=False)",
                )
            ],
        )
    sub.opset_imports.update(graph.opset_imports)
    sub_model = ir.Model(sub, ir_version=model.ir_version)
    proto = ir.serde.serialize_model(sub_model)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=[CPU])
    pos = np.arange(rows, dtype=np.int64)[None, :]
    cos, sin = (np.asarray(a, dtype=np.float32).reshape(rows, width) for a in sess.run(None, {"position_ids": pos}))
    half = rope_dim // 2
    if width == half:
        return np.ascontiguousarray(cos), np.ascontiguousarray(sin)
    if not (np.allclose(cos[:, :half], cos[:, half:]) and np.allclose(sin[:, :half], sin[:, half:])):
        raise ConversionError(
            "cannot move RoPE into the op", [("graph", "cos/sin are not cat(freqs, freqs) as transformers builds them")]
        )
    return np.ascontiguousarray(cos[:, :half]), np.ascontiguousarray(sin[:, :half])
