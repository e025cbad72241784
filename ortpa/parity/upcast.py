"""A model that computes in float16 or bfloat16, rewritten to compute in float32: one half of a float32 twin.

Verification proves a conversion's structure at a float32 bound (:mod:`ortpa.parity.twin`). A model that computes
in a half type itself (a float16 original, a bfloat16 or FP8 checkpoint exported as float16) has nothing wider to
run, and at its own type's bound a wrong scale or RoPE hides in its rounding. :func:`upcast_to_float32` gives it
that wider run: its graph header is changed so that every value it computes in a half type is computed in
float32, from the same weights:

* each half initializer is read as it is stored and cast to float32 by a ``Cast`` node (its name and its bytes
  unchanged: the weights stay in the model's files, memory-mapped);
* each ``Cast`` to a half type casts to float32 instead, each half ``Constant`` / ``ConstantOfShape`` value is
  float32, half ``value_info`` is retyped; in the main graph, its subgraphs and its functions alike;
* half graph inputs and outputs (the logits, the past and present caches) are declared float32. Not kept in their
  declared types behind boundary casts: rounding the logits (2^-11 of their scale) or the caches between decode
  steps to float16 is 30x the float32 bound, the very error the twin exists to leave out.

Applied to both sides (the original, and the conversion before its attention is retargeted), the two differ only
by reordered float32 sums: what the rewrite changed, and nothing of the half arithmetic both share.

ONNX Runtime would fold the initializers' casts into float32 copies at session creation, twice the half weights
in private memory; :func:`twin_session_options` turns constant folding off, so each run casts a weight as the
graph reaches it and frees it after its last use.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ortpa.dtypes import dtype_name

__all__ = [
    "HALF_TYPES",
    "computes_in_half",
    "read_names",
    "round_through",
    "twin_session_options",
    "upcast_to_float32",
]

HALF_TYPES = (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
_FLOAT = onnx.TensorProto.FLOAT
# ops whose element type is an attribute (the rest follow their inputs)
_TYPE_ATTRIBUTES = {
    "Cast": "to",
    "EyeLike": "dtype",
    "RandomNormal": "dtype",
    "RandomNormalLike": "dtype",
    "RandomUniform": "dtype",
    "RandomUniformLike": "dtype",
    "Bernoulli": "dtype",
}
_SUFFIX = "/ortpa_float32"
_ROUNDED = "/ortpa_rounded"


def computes_in_half(proto: onnx.ModelProto) -> bool:
    """Whether ``proto`` stores float weights in a half type (its largest float initializer is half)."""
    best, size = onnx.TensorProto.FLOAT, -1
    for init in proto.graph.initializer:
        if init.data_type in (_FLOAT, *HALF_TYPES):
            n = int(np.prod(init.dims, dtype=np.int64)) if init.dims else 1
            if n > size:
                best, size = init.data_type, n
    return best in HALF_TYPES


def upcast_to_float32(proto: onnx.ModelProto) -> int:
    """Rewrite ``proto``'s header in place to compute in float32 (see the module's docstring); returns how many
    half values were retargeted (initializers, casts, constants, graph inputs and outputs). No weight is read:
    external initializers keep their references."""
    graph = proto.graph
    renamed: dict[str, str] = {}
    casts: list[onnx.NodeProto] = []
    # an initializer nothing reads gets no cast: a cast nothing reads is pruned by ONNX Runtime, and the
    # initializer with it after ortpa registered its weight (int8 caches' scales, which a float32 twin drops)
    read = read_names(graph.node)
    for init in graph.initializer:
        if init.data_type in HALF_TYPES and init.name in read:
            renamed[init.name] = init.name + _SUFFIX
            casts.append(onnx.helper.make_node("Cast", [init.name], [renamed[init.name]], to=_FLOAT))
    # value_info of an initializer (onnx_ir writes them) would contradict it once retyped: its cast is typed
    kept = [vi for vi in graph.value_info if vi.name not in renamed]
    del graph.value_info[:]
    graph.value_info.extend(kept)
    count = len(casts) + _upcast_graph(graph, renamed)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend([*casts, *nodes])  # the casts first: the graph stays topologically sorted
    for value in [*graph.input, *graph.output]:
        if value.type.tensor_type.elem_type in HALF_TYPES:
            value.type.tensor_type.elem_type = _FLOAT
            count += 1
    for function in proto.functions:
        count += _upcast_nodes(function.node, {})
        _retype(function.value_info)
    return count


def round_through(proto: onnx.ModelProto, rounded: dict[str, int]) -> list[str]:
    """In place: each float32 initializer or ``Constant`` output of ``proto``'s main graph named in ``rounded``
    (name -> a half element type T) is read through ``Cast(T)`` then ``Cast(float)``: the graph computes in
    float32 from the values a conversion to T stores (the original's side of a ``dtype=`` conversion's twins). No
    weight is read: the casts run per use (:func:`twin_session_options`). Returns the names rounded."""
    graph = proto.graph
    floats = {i.name for i in graph.initializer if i.data_type == _FLOAT}
    for node in graph.node:
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
            if any(a.name == "value" and a.t.data_type == _FLOAT for a in node.attribute):
                floats.add(node.output[0])
    outputs = {o.name for o in graph.output}
    names = [n for n in rounded if n in floats and n not in outputs]
    renamed = {n: n + _ROUNDED for n in names}
    casts: dict[str, list[onnx.NodeProto]] = {}
    for name in names:
        half = f"{renamed[name]}/{dtype_name(rounded[name])}"
        casts[name] = [
            onnx.helper.make_node("Cast", [name], [half], to=rounded[name]),
            onnx.helper.make_node("Cast", [half], [renamed[name]], to=_FLOAT),
        ]
    nodes = list(graph.node)
    made = {o for n in nodes for o in n.output}
    order = [c for name in names if name not in made for c in casts[name]]  # the initializers' casts first
    for node in nodes:
        _rename_reads(node, renamed)
        order.append(node)
        for out in node.output:  # a Constant's casts right after it: the graph stays topologically sorted
            order.extend(casts.get(out, []))
    del graph.node[:]
    graph.node.extend(order)
    return names


def _rename_reads(node: onnx.NodeProto, renamed: dict[str, str]) -> None:
    """``node`` (and its subgraphs, where no inner value shadows the name) reads each renamed value's new name."""
    for k, name in enumerate(node.input):
        if name in renamed:
            node.input[k] = renamed[name]
    for a in node.attribute:
        for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
            inner = {i.name for i in [*g.initializer, *g.input]} | {o for n in g.node for o in n.output}
            visible = {k: v for k, v in renamed.items() if k not in inner}
            for n in g.node:
                _rename_reads(n, visible)


def read_names(nodes) -> set[str]:
    """Every value ``nodes`` (and their subgraphs) read."""
    names: set[str] = set()
    for node in nodes:
        names.update(node.input)
        for a in node.attribute:
            for g in [a.g] if a.type == onnx.AttributeProto.GRAPH else list(a.graphs):
                names |= read_names(g.node)
    return names


def _upcast_graph(graph: onnx.GraphProto, renamed: dict[str, str]) -> int:
    """Retarget ``graph``'s nodes (and their subgraphs') and ``value_info``; read a renamed initializer through
    its cast."""
    count = _upcast_nodes(graph.node, renamed)
    _retype(graph.value_info)
    return count


def _upcast_nodes(nodes, renamed: dict[str, str]) -> int:
    count = 0
    for node in nodes:
        for k, name in enumerate(node.input):
            if name in renamed:
                node.input[k] = renamed[name]
        key = _TYPE_ATTRIBUTES.get(node.op_type) if node.domain in ("", "ai.onnx") else None
        for a in node.attribute:
            if a.name == key and a.type == onnx.AttributeProto.INT and a.i in HALF_TYPES:
                a.i = _FLOAT
                count += 1
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type in HALF_TYPES:
                a.t.CopyFrom(_float32_tensor(a.t))  # Constant, ConstantOfShape: small, inline
                count += 1
            elif a.type == onnx.AttributeProto.GRAPH:
                # a subgraph's own initializers shadow the outer ones of the same name
                inner = {k: v for k, v in renamed.items() if k not in {i.name for i in a.g.initializer}}
                count += _upcast_subgraph(a.g, inner)
            elif a.type == onnx.AttributeProto.GRAPHS:
                for g in a.graphs:
                    count += _upcast_subgraph(g, renamed)
    return count


def _upcast_subgraph(graph: onnx.GraphProto, renamed: dict[str, str]) -> int:
    count = 0
    for init in graph.initializer:
        if init.data_type in HALF_TYPES:
            init.CopyFrom(_float32_tensor(init))  # a subgraph's initializers are small and inline
            count += 1
    count += _upcast_graph(graph, renamed)
    _retype([*graph.input, *graph.output])
    return count


def _float32_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    out = numpy_helper.from_array(numpy_helper.to_array(tensor).astype(np.float32), tensor.name)
    return out


def _retype(values) -> None:
    for vi in values:
        if vi.type.tensor_type.elem_type in HALF_TYPES:
            vi.type.tensor_type.elem_type = _FLOAT


def twin_session_options(options):
    """``options`` (an ``onnxruntime.SessionOptions``) with constant folding off, so the initializers' casts run
    per use instead of being folded into float32 copies of the weights (twice the half weights' memory). The
    level-3 (layout) optimizations fold them too, whatever is disabled by name: the level stops at extended."""
    import onnxruntime as ort

    options.add_session_config_entry("optimization.disable_specified_optimizers", "ConstantFolding")
    options.enable_cpu_mem_arena = False  # a weight's float32 copy goes back when freed, not into an arena
    options.graph_optimization_level = min(
        options.graph_optimization_level, ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED, key=int
    )
    return options
