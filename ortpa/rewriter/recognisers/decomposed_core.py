"""The attention core of a dense MHA / GQA layer, for :mod:`ortpa.rewriter.recognisers.decomposed`.

From the value cache to the attention that reads it (through repeat_kv): ``MatMul(Softmax(scores), v)`` or ONNX
``Attention``, and from there the query and key as the scores read them, the scale (factors on q / k folded in),
the softcap and the mask; :func:`sliding_window` reads the window a mask encodes. Never mutates the graph; a
failed check raises ``MatchFail`` with a reason and the value it concerns.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import onnx_ir as ir

from ortpa.rewriter._fold import folded_scalar
from ortpa.rewriter._graph import const_array, consumers, int_attr, producer_op, scalar, static_dim
from ortpa.rewriter.recognisers._match import MatchFail, consumer_ops, need, softmax_of, strip_scales

__all__ = ["AttentionCore", "attention_core", "past_row_zeroing", "sliding_window"]

_MAX_MASK_NODES = 400  # the mask subgraph of a tiny or a 70B model is the same few dozen nodes


def _repeated(present: ir.Value) -> list[ir.Value]:
    """``present`` and what repeat_kv makes of it (Unsqueeze -> Expand -> Reshape), in that order."""
    found = [present]
    for unsq in consumers(present, "Unsqueeze"):
        for exp in consumers(unsq.outputs[0], "Expand"):
            found += [r.outputs[0] for r in consumers(exp.outputs[0], "Reshape")]
    return found


@dataclass
class _Scores:
    matmul: ir.Node
    scale: float
    softcap: float
    masks: list[ir.Value]


def _scores(value: ir.Value) -> _Scores:
    """Softmax input -> ``[mask +] softcap*tanh(f*qk/softcap) | f*qk`` -> MatMul(q, k^T)."""
    masks: list[ir.Value] = []
    outer = 1.0
    for _ in range(12):
        node = value.producer()
        need(node is not None and node.domain in ("", "ai.onnx"), "Softmax input is not computed from q @ k^T", value)
        assert node is not None
        if node.op_type == "Cast":
            value = node.inputs[0]
        elif node.op_type == "Add":
            a, b = node.inputs
            # the scores side leads back to a MatMul through few nodes; the mask side to the mask subgraph
            first = a if _reaches_op(a, "MatMul", "Tanh") else b
            masks.append(b if first is a else a)
            value = first
        elif node.op_type in ("Mul", "Div"):
            base, f = strip_scales(value)
            need(base is not value, f"{node.op_type} on the scores by a non-constant", node)
            tanh = producer_op(base, "Tanh")
            if tanh is not None:
                inner_base, inner = strip_scales(tanh.inputs[0])
                mm = producer_op(inner_base, "MatMul")
                need(mm is not None, "Tanh (softcap) input is not scale * (q @ k^T)", tanh)
                assert mm is not None
                # outer * f * tanh(inner * qk): softcap = outer * f, scale = inner * softcap
                cap = outer * f
                need(cap > 0, f"softcap factor {cap} is not positive", node)
                return _Scores(mm, inner * cap, cap, masks)
            outer *= f
            value = base
        elif node.op_type == "MatMul":
            return _Scores(node, outer, 0.0, masks)
        else:
            raise MatchFail(f"Softmax input is not scale * (q @ k^T) [+ mask]: found {node.op_type}", node)
    raise MatchFail("Softmax input: too many nodes before q @ k^T", value)


def _reaches_op(value: ir.Value, *op_types: str, depth: int = 6) -> bool:
    for _ in range(depth):
        node = value.producer()
        if node is None:
            return False
        if node.op_type in op_types:
            return True
        if node.op_type not in ("Mul", "Div", "Cast", "Tanh") or not node.inputs:
            return False
        value = node.inputs[0] if scalar(node.inputs[0]) is None else node.inputs[1]
    return False


@dataclass
class AttentionCore:
    """The attention reading the value cache: its q / k / v as read, output, scale, softcap, masks, kind."""

    query: ir.Value
    key: ir.Value
    value: ir.Value  # the (repeated) value the attention reads, [B,H,T,D]
    attn_out: ir.Value
    scale: float | None  # None: the op's default 1/sqrt(D)
    softcap: float
    masks: list[ir.Value]
    kind: str


def attention_core(present_v: ir.Value) -> AttentionCore:
    """The attention reading the (repeated) value cache: MatMul(Softmax(...), v) or ONNX Attention."""
    for v in _repeated(present_v):
        for node in consumers(v):
            if node.op_type == "Attention" and node.domain in ("", "ai.onnx") and len(node.inputs) > 2:
                if node.inputs[2] is not v:
                    continue
                need(
                    len(node.inputs) < 5 or all(x is None for x in node.inputs[4:]),
                    "ONNX Attention with past_key/past_value inputs: expected the cache as explicit Concat",
                    node,
                )
                need(int_attr(node, "qk_matmul_output_mode", 0) == 0, "ONNX Attention returns qk scores", node)
                need(
                    len(node.outputs) == 1 or all(not o.uses() for o in node.outputs[1:]),
                    "Attention extra outputs used",
                    node,
                )
                attr = node.attributes.get("scale")
                query, qf = strip_scales(node.inputs[0])
                key, kf = strip_scales(node.inputs[1])
                scale = float(attr.value) if attr is not None else None
                if qf * kf != 1.0:  # scalar factors on q / k outside the node multiply its (default) scale
                    d = static_dim(query, -1)
                    need(d is not None, "query head size is not static", query)
                    assert d is not None
                    scale = (scale if scale is not None else 1.0 / math.sqrt(d)) * qf * kf
                softcap = float(node.attributes["softcap"].value) if node.attributes.get("softcap") else 0.0
                masks = [node.inputs[3]] if len(node.inputs) > 3 and node.inputs[3] is not None else []
                if int_attr(node, "is_causal", 0) == 0:
                    need(masks, "ONNX Attention without a mask and is_causal=0 is not causal attention", node)
                return AttentionCore(query, key, v, node.outputs[0], scale, softcap, masks, "onnx-attention")
            if node.op_type == "MatMul" and node.inputs[1] is v:
                softmax = softmax_of(node.inputs[0])
                need(softmax is not None, f"MatMul({node.inputs[0].name}, v): probabilities are not a Softmax", node)
                assert softmax is not None
                need(int_attr(softmax, "axis", -1) in (-1, 3), "Softmax is not over the last axis", softmax)
                s = _scores(softmax.inputs[0])
                query, qf = strip_scales(s.matmul.inputs[0])
                key, kf = strip_scales(s.matmul.inputs[1], through_layout=True)
                # factors on q / k scale q.k inside the tanh too: they belong to scale, not to softcap
                return AttentionCore(
                    query,
                    key,
                    v,
                    past_row_zeroing(node.outputs[0]),
                    s.scale * qf * kf,
                    s.softcap,
                    s.masks,
                    "matmul-softmax",
                )
    raise MatchFail(
        f"no attention (MatMul(p, v) or ONNX Attention) reads the value cache; consumers: {consumer_ops(present_v)}",
        present_v,
    )


def past_row_zeroing(attn_out: ir.Value) -> ir.Value:
    """The attention output after transformers' ``Where(row fully masked, 0, out)`` when there is one.

    transformers 5.x's SDPA export zeroes query rows that see no key. Under a causal mask every query sees
    itself, so no row is fully masked and the Where is the identity; the rewrite replaces its output, which
    also frees the mask it reads (otherwise the mask, and the cache shapes it reads, would stay alive).
    """
    users = attn_out.consumers()
    if len(users) == 1:
        node = users[0]
        zero = const_array(node.inputs[1]) if node.op_type == "Where" and len(node.inputs) == 3 else None
        if zero is not None and node.inputs[2] is attn_out and zero.size <= 1 and not zero.any():
            return node.outputs[0]
    return attn_out


# ops whose output depends on their input's shape only
_SHAPE_ONLY = frozenset({"Shape", "Size"})


def _ancestors(values: list[ir.Value], limit: int = _MAX_MASK_NODES) -> list[ir.Node]:
    """The nodes whose values ``values`` depend on (up to ``limit``), not walking past a ``Shape`` / ``Size``."""
    seen: dict[int, ir.Node] = {}
    queue = deque(values)
    while queue and len(seen) < limit:
        node = queue.popleft().producer()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if node.op_type in _SHAPE_ONLY:
            # its output is the input's shape, never its values: a comparison upstream of that input (the previous
            # layer's window, reached through Shape(key) where optimum cuts the mask to the key's length) does not
            # decide this mask
            continue
        queue.extend(v for v in node.inputs if v is not None and v.const_value is None)
    return list(seen.values())


def _int_scalar(value: ir.Value | None) -> int | None:
    arr = folded_scalar(value)  # a constant, or one folded from static shapes
    if arr is None or arr.dtype.kind not in "iu":
        return None
    return int(arr)


def _offset(value: ir.Value) -> int | None:
    """c when ``value = x - c`` or ``x + (-c)`` with a constant integer c, else None."""
    node = producer_op(value, "Sub", "Add")
    if node is None or len(node.inputs) != 2:
        return None
    c = _int_scalar(node.inputs[1])
    if c is None and node.op_type == "Add":
        c = _int_scalar(node.inputs[0])
        return None if c is None else -c
    if c is None:
        return None
    return c if node.op_type == "Sub" else -c


def sliding_window(masks: list[ir.Value]) -> int:
    """The window the mask encodes, as local_window_size (-1 = none): ``kv > q - W`` (transformers' sliding mask).

    Comparisons of the form ``kv > q - c`` / ``q - c < kv`` give ``W = c``; ``kv >= q - c`` / ``q - c <= kv``
    give ``W = c + 1``. Two different windows in one layer's mask are reported, never guessed.
    """
    windows: set[int] = set()
    for node in _ancestors(masks):
        if node.op_type not in ("Greater", "GreaterOrEqual", "Less", "LessOrEqual") or len(node.inputs) != 2:
            continue
        a, b = node.inputs
        # normalise to "kv OP (q - c)" with OP in {>, >=}
        if node.op_type in ("Greater", "GreaterOrEqual"):
            kv, shifted, strict = a, b, node.op_type == "Greater"
        else:
            kv, shifted, strict = b, a, node.op_type == "Less"
        c = _offset(shifted)
        if c is None or c <= 0 or const_array(kv) is not None:
            continue
        windows.add(c if strict else c + 1)
    need(
        len(windows) <= 1, f"the attention mask encodes several windows {sorted(windows)}", masks[0] if masks else None
    )
    return windows.pop() if windows else -1
