"""Small onnx-ir helpers shared by the rewriter modules: build nodes, read constants, walk uses.

Nodes built here are appended to the graph; callers run ``graph.sort()`` once their surgery is done, so no
helper has to know where in the node list a new node belongs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import onnx_ir as ir

from ortpa.model.widths import static_width

__all__ = [
    "Builder",
    "attr_value",
    "const_array",
    "consumers",
    "int_attr",
    "ints_attr",
    "producer_op",
    "scalar",
    "split_sizes",
    "static_dim",
    "static_width",
]


def const_array(value: ir.Value | None) -> np.ndarray | None:
    """The value as a numpy array when it is a constant (initializer or Constant node), else None."""
    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None else tensor.numpy()


def scalar(value: ir.Value | None) -> float | None:
    """A constant holding exactly one element, as a float; None otherwise."""
    arr = const_array(value)
    if arr is None or arr.size != 1:
        return None
    return float(arr.reshape(()))


def int_attr(node: ir.Node, name: str, default: int | None = None) -> int | None:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.value)


def attr_value(node: ir.Node, name: str, default=None):
    """An attribute's value, or ``default`` when the node does not set it."""
    attr = node.attributes.get(name)
    return default if attr is None else attr.value


def ints_attr(node: ir.Node, name: str) -> list[int] | None:
    attr = node.attributes.get(name)
    return None if attr is None else [int(v) for v in attr.value]


def producer_op(value: ir.Value | None, *op_types: str) -> ir.Node | None:
    """The producer of ``value`` when it is one of ``op_types`` in the default domain, else None."""
    if value is None:
        return None
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or node.op_type not in op_types:
        return None
    return node


def consumers(value: ir.Value, *op_types: str) -> list[ir.Node]:
    """Distinct consumers of ``value`` (restricted to ``op_types`` when given), in graph order of first use."""
    seen: list[ir.Node] = []
    for node in value.consumers():
        if node not in seen and (not op_types or node.op_type in op_types):
            seen.append(node)
    return seen


def static_dim(value: ir.Value | None, axis: int) -> int | None:
    """Dimension ``axis`` of ``value`` when its shape is known and that dim is a number."""
    if value is None or value.shape is None or not -len(value.shape) <= axis < len(value.shape):
        return None
    dim = value.shape[axis]
    return dim if isinstance(dim, int) else None


def split_sizes(node: ir.Node) -> list[int] | None:
    """Sizes of a Split node's outputs when they are constant (input ``split`` or attribute ``split``)."""
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        arr = const_array(node.inputs[1])
        return None if arr is None else [int(v) for v in arr.reshape(-1)]
    return ints_attr(node, "split")


class Builder:
    """Appends nodes and constants to one graph, naming everything under a prefix (e.g. ``/layers.0/mla``)."""

    def __init__(self, graph: ir.Graph, prefix: str) -> None:
        self.graph = graph
        self.prefix = prefix
        self._count = 0

    def _name(self, hint: str) -> str:
        self._count += 1
        return f"{self.prefix}/{hint}_{self._count}"

    def initializer(self, array: np.ndarray, hint: str) -> ir.Value:
        name = self._name(hint)
        tensor = ir.tensor(np.array(array, order="C"), name=name)  # ascontiguousarray would make 0-d arrays 1-d
        value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
        self.graph.register_initializer(value)
        return value

    def ints(self, values: Sequence[int], hint: str = "const") -> ir.Value:
        return self.initializer(np.asarray(values, dtype=np.int64), hint)

    def op(
        self,
        op_type: str,
        inputs: Iterable[ir.Value | None],
        attributes: dict | None = None,
        *,
        domain: str = "",
        num_outputs: int = 1,
        hint: str | None = None,
    ) -> ir.Value | tuple[ir.Value, ...]:
        """Append one node; return its output (or its outputs when ``num_outputs`` > 1)."""
        name = self._name(hint or op_type)
        attrs = ir.convenience.convert_attributes(attributes or {})
        node = ir.Node(domain, op_type, list(inputs), attrs, num_outputs=num_outputs, name=name)
        for i, out in enumerate(node.outputs):
            out.name = f"{name}/out{i}"
        self.graph.append(node)
        return node.outputs[0] if num_outputs == 1 else tuple(node.outputs)
