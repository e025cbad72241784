"""Near-miss graphs: fixtures whose attention computes a value at run time that the export had as a constant.

Each mutation keeps the model's meaning (the same logits as the fixture) but hides a value the recogniser reads
behind graph arithmetic, so the converter must fold it from static shapes or refuse: assuming a default is the
bug these guard against.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["hide_scalar", "runtime_qk_scale"]


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output}


def _const(graph: onnx.GraphProto, name: str, value) -> str:
    graph.initializer.append(numpy_helper.from_array(np.asarray(value), name))
    return name


def runtime_qk_scale(model: onnx.ModelProto, *, axis: int = -1) -> onnx.ModelProto:
    """Decomposed SDPA ``MatMul(q * c, k^T * c)`` with the constant ``c = head_dim ** -0.25`` replaced by the
    value torch's exporter computes at run time: ``Sqrt(1 / Sqrt(Cast(Shape(q)[-1:])))``.

    ``axis=-2`` reads q's sequence axis instead: a scale that changes with the prompt length, which no
    constant can stand in for (the converter must refuse it, naming the node).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    prod = _producers(graph)
    starts = _const(graph, "near_miss.starts", np.array([axis], np.int64))
    ends = _const(graph, "near_miss.ends", np.array([axis + 1 if axis + 1 else np.iinfo(np.int64).max], np.int64))
    one = _const(graph, "near_miss.one", np.array(1.0, np.float32))
    before: dict[int, list[onnx.NodeProto]] = {}  # id of the q-side Mul -> the nodes computing its scale
    for node in graph.node:
        if node.op_type != "MatMul" or not all(prod.get(i) is not None for i in node.input):
            continue
        mq, mk = (prod[i] for i in node.input)
        if mq.op_type != "Mul" or mk.op_type != "Mul" or mq.input[1] != mk.input[1]:
            continue
        p = f"near_miss.{len(before)}."
        before[id(mq)] = [
            helper.make_node("Shape", [mq.input[0]], [p + "shape"], name=p + "Shape"),
            helper.make_node("Slice", [p + "shape", starts, ends], [p + "dim"], name=p + "Slice"),
            helper.make_node("Cast", [p + "dim"], [p + "dimf"], to=onnx.TensorProto.FLOAT, name=p + "Cast"),
            helper.make_node("Sqrt", [p + "dimf"], [p + "sqrt"], name=p + "Sqrt"),
            helper.make_node("Div", [one, p + "sqrt"], [p + "inv"], name=p + "Div"),
            helper.make_node("Sqrt", [p + "inv"], [p + "scale"], name=p + "Scale"),
        ]
        mq.input[1] = mk.input[1] = p + "scale"
    assert before, "no decomposed SDPA MatMul(q * c, k^T * c) found"
    nodes = list(graph.node)
    del graph.node[:]
    for node in nodes:  # q is computed before its Mul (and k^T's Mul comes after the Mul on q)
        graph.node.extend(before.get(id(node), []))
        graph.node.append(node)
    return out


def hide_scalar(model: onnx.ModelProto, const: str, ref: str, *, axis: int = -1) -> onnx.ModelProto:
    """The scalar initializer ``const`` replaced, in every node after ``ref`` is computed, by
    ``Cast(Shape(ref)[axis]) * (const / dim)``: with ``axis`` a static dimension (of size ``dim``) the same value
    computed at run time (foldable); with a symbolic axis (the sequence; ``dim`` 1) one that changes with the
    prompt."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    shapes = {vi.name: vi for vi in onnx.shape_inference.infer_shapes(model).graph.value_info}
    dims = shapes[ref].type.tensor_type.shape.dim
    dim = dims[axis].dim_value if dims[axis].HasField("dim_value") else 1
    value = next(numpy_helper.to_array(i) for i in graph.initializer if i.name == const)
    p = f"near_miss.{const}."
    _const(graph, p + "starts", np.array([axis], np.int64))
    _const(graph, p + "ends", np.array([axis + 1 if axis + 1 else np.iinfo(np.int64).max], np.int64))
    _const(graph, p + "per_dim", (value / dim).astype(value.dtype).reshape(()))
    made = [
        helper.make_node("Shape", [ref], [p + "shape"], name=p + "Shape"),
        helper.make_node("Slice", [p + "shape", p + "starts", p + "ends"], [p + "dim"], name=p + "Slice"),
        helper.make_node(
            "Cast", [p + "dim"], [p + "dimf"], to=numpy_helper.from_array(value).data_type, name=p + "Cast"
        ),
        helper.make_node("Mul", [p + "dimf", p + "per_dim"], [p + "value"], name=p + "Value"),
    ]
    nodes = list(graph.node)
    del graph.node[:]
    seen_ref = False
    for node in nodes:
        if seen_ref:
            for i, name in enumerate(node.input):
                if name == const:
                    node.input[i] = p + "value"
        graph.node.append(node)
        if ref in node.output:
            graph.node.extend(made)
            seen_ref = True
    assert seen_ref, f"{ref} is not computed by any node"
    return out
