"""Whole-model float32 -> float16/bfloat16 (and bfloat16 -> float16): initializers, constants, Casts, graph I/O
and value types.

A plain cast of the graph: it does not keep sensitive ops (norms, softmax) in float32. For best accuracy
export the model in the target precision instead; this exists so a float32 export can run on the op, whose
activations must be float16 or bfloat16. The one exception: an op whose schema at the model's opset does not
accept the target type (``Sin`` / ``Cos`` take no bfloat16 before opset 22) computes in float32 between Casts,
so the converted model stays a valid model.

Index arithmetic stays in float32: exports compute some integer quantities through float32 (MoE routing counts
tokens per expert with ``histc`` over ``expert_ids.float()``; RoPE multiplies ``position_ids.float()`` by the
inverse frequencies). Those values start at a ``Cast`` from an integer type and flow through nodes whose other
inputs are small constants (:func:`_index_floats`); cast to float16 they lose integers past 2048 and bin edges,
and the routing sends tokens to the wrong experts (shape errors at run time). They keep float32, with a ``Cast``
to the target where they meet the model's activations (RoPE's cos/sin, as transformers itself does).

bfloat16 -> float16 is there for a bfloat16 export meant for CPU as well (ONNX Runtime's CPU kernels lack
bfloat16 arithmetic): ``convert --dtype float16`` makes it one that runs everywhere, at the same 2 bytes a weight.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

__all__ = ["convert_float_type", "keep_unsupported_in_float32"]

_FLOAT = ir.DataType.FLOAT


def _sources(target: ir.DataType) -> frozenset[ir.DataType]:
    """The element types that become ``target``: float32 always, bfloat16 too when the target is float16."""
    return frozenset({_FLOAT, ir.DataType.BFLOAT16} if target == ir.DataType.FLOAT16 else {_FLOAT})


def _cast_tensor(tensor: ir.TensorProtocol, target: ir.DataType) -> ir.TensorProtocol:
    """The cast, computed when the tensor is written (lazily, one tensor at a time): casting every weight up
    front would hold the whole converted model in memory at once."""

    def cast() -> ir.Tensor:
        return ir.tensor(tensor.numpy().astype(target.numpy()), name=tensor.name)

    return ir.LazyTensor(cast, dtype=target, shape=tensor.shape, name=tensor.name)


_INT_TYPES = frozenset(
    {
        ir.DataType.INT64,
        ir.DataType.INT32,
        ir.DataType.INT16,
        ir.DataType.INT8,
        ir.DataType.UINT8,
        ir.DataType.UINT16,
        ir.DataType.UINT32,
        ir.DataType.UINT64,
        ir.DataType.BOOL,
    }
)
_SMALL_CONSTANT = 4096  # elements: bin edges, frequencies, scalars; never a weight matrix of a real model


def _small_constant(value: ir.Value) -> bool:
    tensor = value.const_value
    if tensor is None and value.producer() is not None and value.producer().op_type == "Constant":
        attr = value.producer().attributes.get("value")
        tensor = attr.value if attr is not None and attr.type == ir.AttributeType.TENSOR else None
    return tensor is not None and tensor.size <= _SMALL_CONSTANT


def _index_floats(graph: ir.Graph, sources: frozenset[ir.DataType]) -> tuple[set[ir.Value], set[ir.Node]]:
    """Float values computed from integers: a Cast from an integer type, then nodes whose every float input is
    such a value or a small constant. Returns (those values, the nodes computing them)."""
    values: set[ir.Value] = set()
    nodes: set[ir.Node] = set()
    for node in graph:
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
            src = node.inputs[0]
            if src is not None and src.dtype in _INT_TYPES and node.outputs[0].dtype in sources:
                values.add(node.outputs[0])
                nodes.add(node)
            continue
        floats = [v for v in node.inputs if v is not None and v.dtype in sources]
        if not floats or not any(v in values for v in floats):
            continue
        if all(v in values or _small_constant(v) for v in floats):
            nodes.add(node)
            values.update(o for o in node.outputs if o.dtype in sources)
    return values, nodes


def _cast_before(graph: ir.Graph, node: ir.Node, index: int, to: ir.DataType) -> None:
    value = node.inputs[index]
    cast = ir.Node("", "Cast", [value], [ir.AttrInt64("to", to)], name=f"{node.name}/input{index}_{to.name.lower()}")
    cast.outputs[0].name = f"{value.name}/{to.name.lower()}_for_{node.name}"
    cast.outputs[0].type = ir.TensorType(to)
    cast.outputs[0].shape = value.shape
    graph.insert_before(node, cast)
    node.replace_input_with(index, cast.outputs[0])


def convert_float_type(model: ir.Model, target: ir.DataType) -> None:
    """In place: every float32 (and, for float16, bfloat16) tensor, attribute and type in the main graph becomes
    ``target``, except integer-derived index arithmetic (:func:`_index_floats`), which keeps float32."""
    graph = model.graph
    sources = _sources(target)
    index_values, index_nodes = _index_floats(graph, sources)
    for value in graph.initializers.values():
        if value.const_value is not None and value.const_value.dtype in sources:
            if _FLOAT == value.dtype and value.uses() and all(user in index_nodes for user, _ in value.uses()):
                continue  # a constant only index arithmetic reads
            value.const_value = _cast_tensor(value.const_value, target)
    for node in graph:
        if node in index_nodes:
            continue
        if (
            node.op_type == "Constant"
            and all(user in index_nodes for out in node.outputs for user, _ in out.uses())
            and node.outputs[0].uses()
        ):
            continue
        if node.op_type == "Cast" and node.attributes.get("to") is not None:
            if node.attributes["to"].value in sources:
                node.attributes["to"] = ir.AttrInt64("to", target)
        for name in ("value", "value_float"):
            attr = node.attributes.get(name)
            if attr is not None and attr.type == ir.AttributeType.TENSOR and attr.value.dtype in sources:
                node.attributes[name] = ir.AttrTensor(name, _cast_tensor(attr.value, target))
        if node.op_type == "ConstantOfShape" and node.attributes.get("value") is not None:
            pass  # handled above (tensor attribute)
        for out in node.outputs:
            if out.dtype in sources:
                out.type = ir.TensorType(target)
    for value in [*graph.inputs, *graph.outputs, *graph.initializers.values()]:
        if value.dtype in sources and value not in index_values and value.const_value is None:
            value.type = ir.TensorType(target)
        elif value.const_value is not None and value.dtype != value.const_value.dtype:
            value.type = ir.TensorType(value.const_value.dtype)
    # where the two meet: index nodes read float32, every other node reads the target
    for node in list(graph):
        for i, value in enumerate(node.inputs):
            if value is None:
                continue
            if node in index_nodes and value.dtype == target and not (node.op_type == "Cast"):
                _cast_before(graph, node, i, _FLOAT)
            elif node not in index_nodes and value in index_values and value.dtype == _FLOAT:
                if node.op_type == "Cast" or node.domain not in ("", "ai.onnx"):
                    continue  # a Cast says its own target; other domains keep their declared types
                _cast_before(graph, node, i, target)
    keep_unsupported_in_float32(model, target)


def _accepts(schema: onnx.defs.OpSchema, index: int, type_str: str, *, output: bool = False) -> bool:
    params = schema.outputs if output else schema.inputs
    if not params:
        return True
    param = params[min(index, len(params) - 1)]
    allowed = {tc.type_param_str: set(tc.allowed_type_strs) for tc in schema.type_constraints}
    return param.type_str not in allowed or type_str in allowed[param.type_str]


def keep_unsupported_in_float32(model: ir.Model, target: ir.DataType) -> list[str]:
    """In place: default-domain nodes whose schema refuses ``target`` compute in float32 between Casts; the
    names of the nodes changed."""
    graph = model.graph
    opset = model.opset_imports.get("", model.opset_imports.get("ai.onnx", 0))
    type_str = f"tensor({'bfloat16' if target == ir.DataType.BFLOAT16 else 'float16'})"
    changed = []
    for node in list(graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, opset, "")
        except onnx.defs.SchemaError:
            continue
        bad_in = [
            i
            for i, v in enumerate(node.inputs)
            if v is not None and v.dtype == target and not _accepts(schema, i, type_str)
        ]
        if not bad_in:
            continue
        for i in bad_in:
            cast = ir.Node(
                "", "Cast", [node.inputs[i]], [ir.AttrInt64("to", _FLOAT)], name=f"{node.name}/to_float32_{i}"
            )
            cast.outputs[0].name = f"{node.name}/input{i}_float32"
            cast.outputs[0].type = ir.TensorType(_FLOAT)
            graph.insert_before(node, cast)
            node.replace_input_with(i, cast.outputs[0])
        for j, out in enumerate(node.outputs):
            if out.dtype != target:
                continue
            uses = list(out.uses())
            is_output = out in graph.outputs
            out.type = ir.TensorType(_FLOAT)
            back = ir.Node(
                "", "Cast", [out], [ir.AttrInt64("to", target)], name=f"{node.name}/to_{target.name.lower()}_{j}"
            )
            back.outputs[0].type = ir.TensorType(target)
            back.outputs[0].shape = out.shape
            graph.insert_after(node, back)
            for user, index in uses:
                user.replace_input_with(index, back.outputs[0])
            if is_output:
                name = out.name
                out.name = f"{name}/float32"
                back.outputs[0].name = name
                graph.outputs[graph.outputs.index(out)] = back.outputs[0]
            else:
                back.outputs[0].name = f"{out.name}/{target.name.lower()}"
        changed.append(node.name or node.op_type)
    return changed
