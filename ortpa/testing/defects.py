"""Deliberate conversion mistakes, for proving that verification refuses them (tests/test_defects.py,
scripts/defect_margin.py).

Each defect is injected where it means what a wrong conversion would do:

* into the **converted** model, where the rewrite carries a value over into PagedAttention: the softmax
  ``scale`` of one layer, the ``local_window_size`` of every windowed layer, the ``softcap`` of every layer, a
  layer's ``head_sink``, the order of two query heads of one layer (a permutation placed before the cast to T,
  so the float32 twin carries it too), one layer's cache position (``past_seqlens`` + ``amount``) and one
  layer's RMSNorm epsilon (the norms pass through the rewrite unchanged: a rewrite that rebuilt them wrong), the
  scores of one mixture-of-experts router (scaled by ``amount``, -1: it picks the experts it should not, at a
  wide margin: what no routing tie excuses);
* into the **original**, where the model computes the value in its own graph and the converted model reads
  it from there: the RoPE base (every ``inv_freq``-like constant ``b**(-2i/d)`` recomputed for ``b * amount``).
  The conversion of the defected original is then compared with the true original.

All functions take and return :class:`onnx.ModelProto` (small test models, weights inline) and never modify
their input.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["CONVERTED_DEFECTS", "DEFECTS", "ORIGINAL_DEFECTS", "DefectNotApplicable", "inject"]


class DefectNotApplicable(ValueError):
    """The model has nothing the defect could change (no window to shift, no sink to drop...)."""


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _attention(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    nodes = [n for n in model.graph.node if n.op_type == "PagedAttention"]
    if not nodes:
        raise DefectNotApplicable("no PagedAttention node: inject this defect into a converted model")
    return nodes


def _middle(nodes: list):
    return nodes[len(nodes) // 2]


def _attr(node: onnx.NodeProto, name: str, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _set_attr(node: onnx.NodeProto, name: str, value) -> None:
    kept = [a for a in node.attribute if a.name != name]
    del node.attribute[:]
    node.attribute.extend(kept)
    if value is not None:
        node.attribute.append(helper.make_attribute(name, value))


def _width(model: onnx.ModelProto, value: str) -> int:
    for vi in [*model.graph.value_info, *model.graph.input]:
        if vi.name == value:
            dims = vi.type.tensor_type.shape.dim
            if len(dims) == 2 and dims[1].HasField("dim_value"):
                return dims[1].dim_value
    inferred = onnx.shape_inference.infer_shapes(model)
    for vi in inferred.graph.value_info:
        if vi.name == value and len(vi.type.tensor_type.shape.dim) == 2:
            return vi.type.tensor_type.shape.dim[1].dim_value
    raise DefectNotApplicable(f"the width of {value!r} is not declared")


def scale(model: onnx.ModelProto, amount: float = 1.1) -> onnx.ModelProto:
    """One layer's softmax scale times ``amount``."""
    out = _copy(model)
    node = _middle(_attention(out))
    default = None
    if _attr(node, "scale", 0.0) == 0.0:  # the op's default 1/sqrt(head_size); packed QKV holds q, k and v heads
        n = _attr(node, "num_heads") + (0 if node.input[1] else 2 * _attr(node, "kv_num_heads"))
        default = 1.0 / math.sqrt(_width(out, node.input[0]) // n)
    _set_attr(node, "scale", float((_attr(node, "scale", 0.0) or default) * amount))
    return out


def window(model: onnx.ModelProto, amount: int = -1) -> onnx.ModelProto:
    """Every windowed layer's ``local_window_size`` plus ``amount`` (off by one)."""
    out = _copy(model)
    windowed = [n for n in _attention(out) if _attr(n, "local_window_size", -1) > 0]
    if not windowed:
        raise DefectNotApplicable("no layer has a local window")
    for node in windowed:
        _set_attr(node, "local_window_size", int(_attr(node, "local_window_size") + amount))
    return out


def softcap(model: onnx.ModelProto, amount: float = 0.0) -> onnx.ModelProto:
    """Every layer's softcap dropped (``amount`` 0) or multiplied by ``amount``."""
    out = _copy(model)
    capped = [n for n in _attention(out) if _attr(n, "softcap", 0.0) > 0]
    if not capped:
        raise DefectNotApplicable("no layer has a softcap")
    for node in capped:
        _set_attr(node, "softcap", float(_attr(node, "softcap") * amount) if amount else None)
    return out


def sink(model: onnx.ModelProto, amount: float = 0.0) -> onnx.ModelProto:
    """One layer's attention sinks dropped (``amount`` 0), or scaled by ``amount``."""
    out = _copy(model)
    with_sink = [n for n in _attention(out) if len(n.input) > 11 and n.input[11]]
    if not with_sink:
        raise DefectNotApplicable("no layer has a head_sink")
    node = _middle(with_sink)
    if not amount:
        node.input[11] = ""
        return out
    # scaled before the cast to T where there is one (the float32 twin then carries the defect too)
    producers = {o: p for p in out.graph.node for o in p.output}
    cast = producers.get(node.input[11])
    target, slot = (cast, 0) if cast is not None and cast.op_type == "Cast" else (node, 11)
    source = target.input[slot]
    # the multiplier in the sink's own type: float32 before the cast of a float32 original's conversion, T where
    # the sink is stored in T (a dtype= conversion rounds it before its cast)
    stored = {i.name: i.data_type for i in out.graph.initializer}
    kind = stored.get(source, onnx.TensorProto.FLOAT if target is cast else onnx.TensorProto.FLOAT16)
    dtype = helper.tensor_dtype_to_np_dtype(kind)
    k = numpy_helper.from_array(np.array(amount, dtype), f"{node.name}/defect_sink/k")
    out.graph.initializer.append(k)
    out.graph.node.append(helper.make_node("Mul", [source, k.name], [f"{node.name}/defect_sink"]))
    target.input[slot] = f"{node.name}/defect_sink"
    return _sorted(out)


def heads(model: onnx.ModelProto, amount: int = 1) -> onnx.ModelProto:
    """One layer's query heads 0 and ``amount`` swapped (before the cast to T, so the float32 twin has it)."""
    out = _copy(model)
    node = _middle(_attention(out))
    n = _attr(node, "num_heads") + (0 if node.input[1] else 2 * _attr(node, "kv_num_heads"))
    width = _width(out, node.input[0])
    producers = {o: p for p in out.graph.node for o in p.output}
    cast = producers.get(node.input[0])
    target = cast if cast is not None and cast.op_type == "Cast" else node
    source = target.input[0]
    perm = list(range(n))
    perm[0], perm[amount] = perm[amount], perm[0]
    name = f"{node.name}/defect_heads"
    shape3 = numpy_helper.from_array(np.array([-1, n, width // n], np.int64), f"{name}/shape3")
    shape2 = numpy_helper.from_array(np.array([-1, width], np.int64), f"{name}/shape2")
    index = numpy_helper.from_array(np.array(perm, np.int64), f"{name}/perm")
    out.graph.initializer.extend([shape3, shape2, index])
    out.graph.node.extend(
        [
            helper.make_node("Reshape", [source, shape3.name], [f"{name}/3d"]),
            helper.make_node("Gather", [f"{name}/3d", index.name], [f"{name}/swapped"], axis=1),
            helper.make_node("Reshape", [f"{name}/swapped", shape2.name], [f"{name}/out"]),
        ]
    )
    target.input[0] = f"{name}/out"
    return _sorted(out)


def cache_position(model: onnx.ModelProto, amount: int = 1) -> onnx.ModelProto:
    """One layer reads and writes its cache ``amount`` positions later (``past_seqlens`` + ``amount``)."""
    out = _copy(model)
    node = _middle(_attention(out))
    shifted = f"{node.name}/defect_past_seqlens"
    k = numpy_helper.from_array(np.array(amount, np.int32), f"{shifted}/k")
    out.graph.initializer.append(k)
    out.graph.node.append(helper.make_node("Add", [node.input[6], k.name], [shifted]))
    node.input[6] = shifted
    return _sorted(out)


def norm_eps(model: onnx.ModelProto, amount: float = 100.0) -> onnx.ModelProto:
    """One layer's RMSNorm epsilon times ``amount``: an ``epsilon`` attribute (SimplifiedLayerNormalization,
    RMSNormalization...) or the constant a decomposed norm adds to its ``ReduceMean``."""
    out = _copy(model)
    producers = {o: p for p in out.graph.node for o in p.output}
    found: list[tuple[onnx.NodeProto, int | None]] = []
    for node in out.graph.node:
        if _attr(node, "epsilon") is not None:
            found.append((node, None))
        elif node.op_type == "Add" and len(node.input) == 2:
            for k in (0, 1):
                other = producers.get(node.input[1 - k])
                value = _constant(out, node.input[k])
                if other is not None and other.op_type == "ReduceMean" and value is not None and value.size == 1:
                    if 0 < float(value.reshape(-1)[0]) < 1e-2:
                        found.append((node, k))
    if not found:
        raise DefectNotApplicable("no RMSNorm epsilon found")
    node, k = _middle(found)
    if k is None:
        _set_attr(node, "epsilon", float(_attr(node, "epsilon") * amount))
    else:
        value = _constant(out, node.input[k])
        assert value is not None
        name = f"{node.name or node.output[0]}/defect_eps"
        out.graph.initializer.append(numpy_helper.from_array((value * amount).astype(value.dtype), name))
        node.input[k] = name
    return out


def routing(model: onnx.ModelProto, amount: float = -1.0) -> onnx.ModelProto:
    """The scores of the middle router (:func:`ortpa.parity.routing.find_routers`) times ``amount`` before its
    TopK."""
    from ortpa.parity.routing import find_routers

    routers = find_routers(model)
    if not routers:
        raise DefectNotApplicable("no router (a TopK choosing experts): inject this defect into an MoE model")
    router = _middle(routers)
    out = _copy(model)
    node = next(n for n in out.graph.node if n.op_type == "TopK" and n.output[1] == router.indices)
    elem = next(
        (
            vi.type.tensor_type.elem_type
            for vi in onnx.shape_inference.infer_shapes(out).graph.value_info
            if vi.name == router.scores
        ),
        onnx.TensorProto.FLOAT,
    )
    factor = f"{router.scores}__defect_factor"
    scaled = f"{router.scores}__defect_scaled"
    out.graph.initializer.append(
        numpy_helper.from_array(np.array(amount, dtype=onnx.helper.tensor_dtype_to_np_dtype(elem)), factor)
    )
    out.graph.node.append(helper.make_node("Mul", [router.scores, factor], [scaled]))
    node.input[0] = scaled
    return _sorted(out)


def rope_base(model: onnx.ModelProto, amount: float = 2.0) -> onnx.ModelProto:
    """The RoPE base ``b`` of an original times ``amount``: every float initializer ``b**(-2i/d)`` (``inv_freq``:
    1, decreasing geometrically) recomputed for ``b * amount``, and every cos/sin table pair (onnxruntime-genai's
    ``cos_cache``/``sin_cache``: ``[positions, d/2]``, ``cos(p * inv_freq_i)``) recomputed for it."""
    out = _copy(model)
    changed = _rope_tables(out, amount)
    for init in out.graph.initializer:
        a = numpy_helper.to_array(init)
        flat = a.reshape(-1)
        if a.dtype.kind != "f" or not 2 <= flat.size <= 512 or flat[0] != 1.0 or not 0 < flat[1] < 1:
            continue
        ratio = flat[1:] / flat[:-1]
        if not np.allclose(ratio, ratio[0], rtol=1e-3):
            continue
        half = flat.size
        base = float(flat[1]) ** (-half)  # flat[1] = b**(-1/half)
        new = (1.0 / (base * amount) ** (np.arange(half, dtype=np.float64) / half)).astype(a.dtype).reshape(a.shape)
        init.CopyFrom(numpy_helper.from_array(new, init.name))
        changed += 1
    if not changed:
        raise DefectNotApplicable(
            "no inv_freq-like constant (1, b**(-1/h), b**(-2/h), ...) nor cos/sin table pair in the original"
        )
    return out


def _rope_tables(model: onnx.ModelProto, amount: float) -> int:
    """Recompute each cos/sin table pair of ``model`` (same shape ``[positions, h]``, row 0 all ones / all zeros)
    for a base times ``amount``: column ``i``'s frequency (read from row 1, scaling included) times
    ``amount**(-i/h)``, as ``inv_freq_i = b**(-i/h)`` gives."""
    tables = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer if len(i.dims) == 2 and i.dims[0] > 1}
    pairs = []
    for cos_name, c in tables.items():
        for sin_name, s in tables.items():
            if c.shape == s.shape and c.dtype.kind == "f" and np.all(c[0] == 1) and np.all(s[0] == 0) and s.any():
                if np.allclose(c.astype(np.float64) ** 2 + s.astype(np.float64) ** 2, 1.0, atol=1e-2):
                    pairs.append((cos_name, sin_name))
    for cos_name, sin_name in pairs:
        c, s = tables[cos_name].astype(np.float64), tables[sin_name].astype(np.float64)
        h = c.shape[1]
        freq = np.arctan2(s[1], c[1]) * float(amount) ** (-np.arange(h) / h)
        angle = np.arange(c.shape[0], dtype=np.float64)[:, None] * freq[None]
        for init in model.graph.initializer:
            if init.name in (cos_name, sin_name):
                table = np.cos(angle) if init.name == cos_name else np.sin(angle)
                init.CopyFrom(numpy_helper.from_array(table.astype(tables[init.name].dtype), init.name))
    return len(pairs)


def _constant(model: onnx.ModelProto, name: str) -> np.ndarray | None:
    for init in model.graph.initializer:
        if init.name == name:
            return numpy_helper.to_array(init)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            for a in node.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
                if a.name == "value_float":
                    return np.array(a.f, np.float32)
    return None


def _sorted(model: onnx.ModelProto) -> onnx.ModelProto:
    """Appended nodes moved before their first reader (ONNX graphs are topologically sorted)."""
    import onnx_ir as ir

    irm = ir.serde.deserialize_model(model)
    irm.graph.sort()
    return ir.serde.serialize_model(irm)


CONVERTED_DEFECTS: dict[str, Callable[..., onnx.ModelProto]] = {
    "scale": scale,
    "window": window,
    "softcap": softcap,
    "heads": heads,
    "sink": sink,
    "norm_eps": norm_eps,
    "cache_position": cache_position,
    "routing": routing,
}
ORIGINAL_DEFECTS: dict[str, Callable[..., onnx.ModelProto]] = {"rope_base": rope_base}
DEFECTS = (*CONVERTED_DEFECTS, *ORIGINAL_DEFECTS)


def inject(kind: str, model: onnx.ModelProto, amount=None) -> onnx.ModelProto:
    """``model`` with defect ``kind`` (a name of :data:`DEFECTS`); ``amount`` as the defect's function takes it
    (default: the issue's size: scale x1.1, window -1, softcap and sink dropped, heads 0/1, cache +1, eps x100,
    RoPE base x2). Converted-model defects take the converted model, :data:`ORIGINAL_DEFECTS` the original."""
    table = {**CONVERTED_DEFECTS, **ORIGINAL_DEFECTS}
    if kind not in table:
        raise KeyError(f"unknown defect {kind!r}; expected one of {list(DEFECTS)}")
    return table[kind](model) if amount is None else table[kind](model, amount)
