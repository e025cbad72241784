"""Which exporter made a dense ONNX LLM, and how to feed it: the source side of ``ortpa parity``.

The dense models people have come from a handful of tools, each with its own graph interface:

======================  =====================================================================================
``ortpa_dynamo``        ``torch.onnx.export(dynamo=True)`` (``ortpa export``): ``input_ids``, ``attention_mask``,
                        ``position_ids``, ``past_key_values.{i}.key/.value`` -> ``logits``, ``present.*``.
``genai_gqa``           onnxruntime-genai builder, fp32 / int4 on CPU: one ``com.microsoft::GroupQueryAttention``
                        per layer; ``attention_mask`` only (no ``position_ids``); past ``[batch, kv_heads, past,
                        kv_cache_dim]`` with the head size a symbol; a sliding-window layer (Gemma-2) has a
                        ring-buffer cache of ``local_window_size`` rows (``sliding_window_cache=1``).
``genai_mha``           onnxruntime-genai builder, fp16: ``RotaryEmbedding`` + ``MultiHeadAttention``;
                        ``attention_mask`` and ``position_ids``; float16 caches and logits.
``optimum``             optimum's TorchScript-era export (``text-generation-with-past``): decomposed attention,
                        ``attention_mask`` + ``position_ids``, the same cache names as ``ortpa_dynamo``.
``onnx_exporter``       transformers 5.x ``OnnxExporter`` decode model: no ``attention_mask``, ``position_ids``,
                        caches ``input.cache.layers.{i}.keys/.values`` -> ``output.cache.layers.{i}.*``;
                        a sliding layer also hands back an unread scalar ``..._sliding_window_tensor``.
======================  =====================================================================================

:func:`detect_format` tells them apart from the graph's ops and I/O; :func:`dense_interface` describes what a
runner must feed (which of mask / positions the graph declares, each layer's cache pair with its heads, head
sizes and dtype). Where a cache's head size is a symbol (genai's ``kv_cache_dim``), it is found from the
attention op's attributes and the width of the projection that feeds it (:mod:`ortpa.formats.shapes`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

import numpy as np
import onnx
import onnx_ir as ir

from ortpa.dtypes import onnx_elem_type
from ortpa.errors import InvalidModel
from ortpa.formats.shapes import cache_capacity, cache_head_size, constant_ints, ir_graph

__all__ = [
    "CacheIO",
    "DenseInterface",
    "SourceFormat",
    "dense_interface",
    "detect_format",
    "length_thresholds",
    "session_interface",
]


class SourceFormat(str, Enum):
    """The exporter a dense model comes from (see the module docstring for each interface)."""

    ORTPA_DYNAMO = "ortpa_dynamo"
    GENAI_GQA = "genai_gqa"
    GENAI_MHA = "genai_mha"
    OPTIMUM = "optimum"
    ONNX_EXPORTER = "onnx_exporter"


_ID_NAMES = ("input_ids",)
_MASK_NAMES = ("attention_mask",)
_POSITION_NAMES = ("position_ids",)
_FLOAT_TYPES = {onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


@dataclass(frozen=True)
class CacheIO:
    """One layer's cache: the graph inputs fed as past and the outputs read back as present."""

    layer: int
    key_input: str
    value_input: str
    key_output: str
    value_output: str
    kv_heads: int
    key_head_size: int
    value_head_size: int
    dtype: np.dtype
    capacity: int | None = None  # a ring buffer of this many rows (genai sliding-window layers), else grows

    def empty(self, batch: int = 1) -> dict[str, np.ndarray]:
        """Past tensors for a first (prefill) step: ``[batch, kv_heads, 0, head]``, or the zeroed ring buffer."""
        rows = self.capacity or 0
        return {
            self.key_input: np.zeros((batch, self.kv_heads, rows, self.key_head_size), self.dtype),
            self.value_input: np.zeros((batch, self.kv_heads, rows, self.value_head_size), self.dtype),
        }


@dataclass(frozen=True)
class DenseInterface:
    """What a runner feeds a dense past/present model and reads back, in the model's own format."""

    format: SourceFormat | None  # None when built from a session's I/O alone (no graph to look at)
    input_ids: str
    attention_mask: str | None
    position_ids: str | None
    logits: str
    caches: tuple[CacheIO, ...]
    batch: int | None  # a batch size fixed in the graph (OnnxExporter exports batch 1), else None
    # scalar state inputs the graph only hands back unread (:func:`_pass_throughs`), fed a zero each step
    pass_throughs: tuple[str, ...] = ()

    def empty_past(self) -> dict[str, np.ndarray]:
        past: dict[str, np.ndarray] = {}
        for c in self.caches:
            past.update(c.empty(self.batch or 1))
        return past

    def feed(self, ids: list[int], past_length: int, past: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Inputs for one step of one sequence: ``ids`` new tokens after ``past_length`` cached ones."""
        n = len(ids)
        feed = {self.input_ids: np.array([ids], np.int64), **past}
        for name in self.pass_throughs:
            feed[name] = np.zeros((), np.int64)
        if self.attention_mask is not None:
            feed[self.attention_mask] = np.ones((1, past_length + n), np.int64)
        if self.position_ids is not None:
            feed[self.position_ids] = np.arange(past_length, past_length + n, dtype=np.int64)[None]
        return feed

    def next_past(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This step's present tensors, renamed as the next step's past."""
        past = {}
        for c in self.caches:
            past[c.key_input] = outputs[c.key_output]
            past[c.value_input] = outputs[c.value_output]
        return past


# ------------------------------------------------------------------------------------------------- detection
def _ops(model: onnx.ModelProto) -> set[tuple[str, str]]:
    return {(n.domain or "", n.op_type) for n in model.graph.node}


def detect_format(model: onnx.ModelProto) -> SourceFormat:
    """The exporter that made ``model``, from its attention ops and its graph I/O.

    Raises :class:`~ortpa.errors.InvalidModel` for a model that is already paged or has no KV cache inputs.
    """
    ops = _ops(model)
    if ("com.microsoft", "PagedAttention") in ops:
        raise InvalidModel(model.graph.name or "<model>", "expected a dense past/present model, found a paged one")
    if ("com.microsoft", "GroupQueryAttention") in ops:
        return SourceFormat.GENAI_GQA
    if ("com.microsoft", "MultiHeadAttention") in ops:
        return SourceFormat.GENAI_MHA
    names = [i.name for i in model.graph.input]
    if not _cache_inputs(model.graph.input):
        raise InvalidModel(
            model.graph.name or "<model>",
            f"expected 4-D float KV cache inputs (past/present model), found inputs {names}",
        )
    if not any(n in _MASK_NAMES for n in names):
        return SourceFormat.ONNX_EXPORTER
    # TorchScript exports name nodes by module scope ("/model/layers.0/self_attn/MatMul"); the dynamo exporter
    # names them after the FX graph ("node_MatMul_12") and never with a leading "/".
    scoped = sum(1 for n in model.graph.node if n.name.startswith("/"))
    return SourceFormat.OPTIMUM if scoped > len(model.graph.node) // 2 else SourceFormat.ORTPA_DYNAMO


# ------------------------------------------------------------------------------------------------ interface
def _dims(value: onnx.ValueInfoProto) -> list[int | str | None]:
    out: list[int | str | None] = []
    for d in value.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            out.append(d.dim_value)
        elif d.dim_param.isdigit():  # transformers' OnnxExporter writes fixed dims as strings ("2")
            out.append(int(d.dim_param))
        else:
            out.append(d.dim_param or None)
    return out


def _cache_inputs(values) -> list[onnx.ValueInfoProto]:
    return [
        v
        for v in values
        if v.type.tensor_type.elem_type in _FLOAT_TYPES
        and len(v.type.tensor_type.shape.dim) == 4
        and v.name not in (*_ID_NAMES, *_MASK_NAMES, *_POSITION_NAMES)
    ]


_LAYER = re.compile(r"(\d+)")
# past name -> present name, per exporter; a model matching none pairs caches by order.
_RENAMES = (("past_key_values", "present"), ("input.cache.", "output.cache."), ("past_key", "present_key"))


def _role(name: str) -> str:
    tail = name.rsplit(".", 1)[-1].lower()
    if tail.startswith("key") or tail.endswith("key") or tail == "k":
        return "key"
    if tail.startswith("value") or tail.endswith("value") or tail == "v":
        return "value"
    raise InvalidModel(name, "expected a cache input whose name ends in key(s) or value(s)")


def _layer(name: str) -> int:
    found = _LAYER.findall(name)
    if not found:
        raise InvalidModel(name, "expected a layer number in the cache input's name")
    return int(found[-1])


def _present_for(past: str, outputs: list[str], index: int, ordered: list[str]) -> str:
    for old, new in _RENAMES:
        if old in past and past.replace(old, new) in outputs:
            return past.replace(old, new)
    return ordered[index]


def _static(dim, what: str, where: str) -> int:
    if isinstance(dim, int):
        return dim
    raise InvalidModel(where, f"expected a fixed {what}, found the symbol {dim!r}")


def _pass_throughs(model: onnx.ModelProto | None, inputs) -> tuple[str, ...]:
    """Scalar integer inputs the graph reads only to hand them back as an output: transformers 5's OnnxExporter
    round-trips each sliding-window cache layer's ``_sliding_window_tensor`` (its window, as a cache attribute)
    through an ``Identity``, and computes the window from constants in the mask. Unread, their value cannot
    change an output, so any is right; one a node computes with is refused, naming the node, not guessed."""
    scalars = [
        v.name
        for v in inputs
        if v.type.tensor_type.elem_type in (onnx.TensorProto.INT64, onnx.TensorProto.INT32)
        and not v.type.tensor_type.shape.dim
        and v.name.endswith("_sliding_window_tensor")
    ]
    if not scalars:
        return ()
    if model is None:  # only the session's I/O: nothing says they are unread
        raise InvalidModel(scalars[0], "expected the model's graph to check that this scalar input is unread")
    graph_outputs = {o.name for o in model.graph.output}
    for node in model.graph.node:
        for name in scalars:
            if name in node.input and not (node.op_type == "Identity" and node.output[0] in graph_outputs):
                raise InvalidModel(
                    name,
                    f"expected the scalar input only handed back through an Identity to a graph output, found it "
                    f"read by {node.op_type} node {node.name!r}",
                )
    return tuple(scalars)


def _interface(model: onnx.ModelProto | None, inputs, outputs, fmt: SourceFormat | None) -> DenseInterface:
    input_names = [i.name for i in inputs]
    output_names = [o.name for o in outputs]
    past = _cache_inputs(inputs)
    present = [o.name for o in _cache_inputs(outputs)]
    if len(past) != len(present) or len(past) % 2:
        raise InvalidModel(
            "<model>", f"expected one present output per past input, found {len(past)} past, {len(present)} present"
        )
    by_name = {v.name: v for v in [*inputs, *outputs]}
    layers: dict[int, dict[str, tuple[str, str]]] = {}
    for i, v in enumerate(past):
        layers.setdefault(_layer(v.name), {})[_role(v.name)] = (v.name, _present_for(v.name, output_names, i, present))
    caches = []
    batch: int | None = None
    graph = ir_graph(model) if model is not None else None
    for layer, pair in sorted(layers.items()):
        if set(pair) != {"key", "value"}:
            raise InvalidModel(pair[next(iter(pair))][0], f"expected a key and a value cache for layer {layer}")
        heads = []
        for role in ("key", "value"):
            name, out_name = pair[role]
            dims, out_dims = _dims(by_name[name]), _dims(by_name[out_name])
            head = dims[3] if isinstance(dims[3], int) else out_dims[3]
            if not isinstance(head, int) and graph is not None:
                head = cache_head_size(graph, name)
            heads.append(_static(head, "head size (dim 3)", name))
            kv = _static(dims[1] if isinstance(dims[1], int) else out_dims[1], "KV head count (dim 1)", name)
            if isinstance(dims[0], int):
                batch = dims[0]
        elem = by_name[pair["key"][0]].type.tensor_type.elem_type
        caches.append(
            CacheIO(
                layer,
                pair["key"][0],
                pair["value"][0],
                pair["key"][1],
                pair["value"][1],
                kv,
                heads[0],
                heads[1],
                np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)),
                cache_capacity(graph, pair["key"][0]) if graph is not None else None,
            )
        )
    if "input_ids" not in input_names:
        raise InvalidModel("<model>", f"expected an input_ids input, found inputs {input_names}")
    logits = "logits" if "logits" in output_names else output_names[0]
    return DenseInterface(
        format=fmt,
        input_ids="input_ids",
        attention_mask=next((n for n in input_names if n in _MASK_NAMES), None),
        position_ids=next((n for n in input_names if n in _POSITION_NAMES), None),
        logits=logits,
        caches=tuple(caches),
        batch=batch,
        pass_throughs=_pass_throughs(model, inputs),
    )


def dense_interface(model: onnx.ModelProto) -> DenseInterface:
    """Describe how to drive ``model`` (its format, inputs, caches); weights need not be loaded."""
    fmt = detect_format(model)
    return _interface(model, list(model.graph.input), list(model.graph.output), fmt)


def _value_info(arg) -> onnx.ValueInfoProto:
    """An ``onnx.ValueInfoProto`` built from an onnxruntime ``NodeArg`` (name, type, shape)."""
    shape = [d if isinstance(d, int) else (str(d) if d is not None else None) for d in (arg.shape or [])]
    try:
        elem = onnx_elem_type(arg.type)  # ONNX Runtime's spelling, "tensor(float16)"
    except TypeError:
        elem = onnx.TensorProto.UNDEFINED
    return onnx.helper.make_tensor_value_info(arg.name, elem, shape)


def session_interface(session) -> DenseInterface:
    """Describe a dense model from an onnxruntime session's declared I/O only (no graph: format unknown).

    Works when every cache's head size is a fixed dim; otherwise pass :func:`dense_interface` of the model.
    """
    inputs = [_value_info(a) for a in session.get_inputs()]
    outputs = [_value_info(a) for a in session.get_outputs()]
    return _interface(None, inputs, outputs, None)


def length_thresholds(model: onnx.ModelProto) -> list[int]:
    """Sequence lengths past which the model computes differently, found in the graph (sorted, unique).

    * LongRoPE: a ``Greater(length, C)`` whose result picks the RoPE tables or frequencies (``If`` between
      two caches: onnxruntime-genai; ``Where`` between two inverse-frequency tensors: dynamo exports);
    * ``GroupQueryAttention``'s ``local_window_size`` (a sliding window).

    A parity run needs a prompt longer than each, or it never exercises the other branch.
    """
    found: set[int] = set()
    graph: ir.Graph | None = None  # made on the first constant asked for
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    for n in model.graph.node:
        if n.op_type == "GroupQueryAttention":
            window = next((a.i for a in n.attribute if a.name == "local_window_size"), -1)
            if window > 0:
                found.add(int(window))
        if n.op_type == "Greater" and any(c.op_type in ("If", "Where") for c in consumers.get(n.output[0], [])):
            graph = graph if graph is not None else ir_graph(model)
            value = constant_ints(graph, n.input[1])
            if value is not None and len(value) == 1 and value[0] > 0:
                found.add(value[0])
    return sorted(found)
