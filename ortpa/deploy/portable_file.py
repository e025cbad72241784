"""``convert --portable``: lower every PagedAttention node of a converted, validated graph to standard ONNX ops.

:func:`lower_graph` works on the graph only (weights stay in ``<out>.data``, or in the protobuf of a small inline
model, modified in place and never copied): each node becomes a call to a model-local function
(:mod:`ortpa.ops.portable`), and ONNX Runtime must open the result on CPU with no custom op. The conversion
(:mod:`ortpa.conversion`) lowers the staged model's graph before it is published; :func:`lower_file` lowers a
paged file made elsewhere, in place (atomically).

LATENT (MLA) layers: ``split_latent`` stores each latent row in two halves, channels ``[0, H/2)`` in
``past_key_values.{i}.key`` and ``[H/2, H)`` in a new ``past_key_values.{i}.value`` (both ``[num_blocks,
block_size, 1, H/2]``), with ``present.{i}.value`` beside ``present.{i}.key``. Runtimes that allocate a key and a
value cache of one head size per layer (onnxruntime-genai's Engine) then run the file at the LATENT memory: one
latent row per token, not a key and a value row of the full width.

The metadata says what was done: ``ortpa.portable`` = JSON ``{"lowered": true, "nodes": n, "kv_cache_layout":
..., "split_latent": ..., "head_size": H, "cache_head_size": ..., "kv_num_heads": ..., "num_heads": ...,
"configs": [the PagedAttention attributes of each distinct node configuration], "if_free": ..., "dropped_inputs":
[...]}``, and
``ortpa.portable.min_onnxruntime`` = the oldest ONNX Runtime release that runs the file (:func:`min_onnxruntime`):
a runtime that is not ortpa reads it from the model's metadata before its first run (``docs/converted_model.md``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import onnx
from onnx import helper

from ortpa.errors import ConversionError
from ortpa.model.kind import PORTABLE_METADATA_KEY
from ortpa.ops.portable import LayerCall, layer_call, lower_nodes, node_attributes, value_types
from ortpa.ops.shape_inference import infer_shapes
from ortpa.ops.spec import OP_TYPE, PAGED_ATTENTION
from ortpa.ops.trailing_write import trailing_writes
from ortpa.providers import CPU

__all__ = [
    "METADATA_KEY",
    "MIN_ONNXRUNTIME",
    "MIN_ONNXRUNTIME_KEY",
    "PortableInfo",
    "lower_file",
    "lower_graph",
    "min_onnxruntime",
    "portable_info",
]

METADATA_KEY = PORTABLE_METADATA_KEY
MIN_ONNXRUNTIME_KEY = f"{PORTABLE_METADATA_KEY}.min_onnxruntime"
# The oldest release the compatibility matrix runs (scripts/compat_matrix.py: tokens equal ortpa's); older ones
# are refused by the file's metadata, not by its graph (docs/portable.md, "Which ONNX Runtime releases").
MIN_ONNXRUNTIME = "1.20"
# The first release that loads a model of each newer default-domain opset (older releases refuse such a file when
# they open it, with a message); measured with each release's wheel, see docs/portable.md.
_OPSET_RELEASE = {22: "1.21", 23: "1.23", 24: "1.24", 25: "1.24", 26: "1.25"}


def min_onnxruntime(opset: int) -> str:
    """The oldest ONNX Runtime release that runs a lowered file whose default-domain opset is ``opset`` (an opset
    newer than the table's: the newest entry; releases that do not know it refuse to load the file themselves)."""
    needed = [release for version, release in _OPSET_RELEASE.items() if version <= opset]
    return max([MIN_ONNXRUNTIME, *needed], key=lambda v: tuple(map(int, v.split("."))))


@dataclass(frozen=True)
class PortableInfo:
    """What :func:`lower_file` did, as recorded in the file's metadata."""

    nodes: int
    kv_cache_layout: str  # SEPARATE or LATENT
    split_latent: bool
    num_heads: int
    kv_num_heads: int
    head_size: int  # the op's head size (the latent width for LATENT)
    cache_head_size: int  # the last dimension of each cache input as written (H/2 when split)
    configs: tuple[dict, ...]
    if_free: bool = False  # no If in the graph (lower_graph's ``if_free``)
    dropped_inputs: tuple[str, ...] = ()  # graph inputs nothing read after the lowering (if_free only)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["configs"] = list(self.configs)
        return json.dumps({"lowered": True, **d}, sort_keys=True)


def portable_info(model: onnx.ModelProto) -> PortableInfo | None:
    """The lowering a file's metadata records, or None for a file that was not lowered by :func:`lower_file`."""
    meta = {p.key: p.value for p in model.metadata_props}
    if METADATA_KEY not in meta:
        return None
    d = json.loads(meta[METADATA_KEY])
    d.pop("lowered", None)
    d["configs"] = tuple(d.get("configs", ()))
    d["dropped_inputs"] = tuple(d.get("dropped_inputs", ()))
    return PortableInfo(**d)


def _weightless(proto: onnx.ModelProto) -> onnx.ModelProto:
    from ortpa.rewriter.ort_check import weightless  # rewriter: the conversion's own weight-free view

    return weightless(proto)


def lower_file(
    path: str | os.PathLike, *, split_latent: bool = True, check_session: bool = True, if_free: bool = False
) -> PortableInfo:
    """Lower every PagedAttention node of the model file ``path`` in place (atomically); what was done. For a paged
    file made elsewhere (``ortpa convert --portable`` lowers its graph before the file is published)."""
    path = Path(path)
    proto = onnx.load(str(path), load_external_data=False)
    info = lower_graph(proto, str(path), split_latent=split_latent, check_session=check_session, if_free=if_free)
    _replace(proto, path)
    return info


def lower_graph(
    proto: onnx.ModelProto,
    where: str,
    *,
    split_latent: bool = True,
    check_session: bool = True,
    if_free: bool = False,
) -> PortableInfo:
    """Lower every PagedAttention node of ``proto`` (its graph; weights may stay external) in place; what was done.
    ``where`` names the model in messages. ``if_free``: the form without ``If`` (both attention groups at every
    step, padded so that nothing is empty), which compilers that refuse ``If`` bodies (the OpenVINO EP) accept.

    Raises :class:`~ortpa.errors.ConversionError` when a node cannot be lowered (float8 or packed int4 caches,
    symbolic head sizes), when ``split_latent`` meets an odd latent width or a quantized latent cache, or when ONNX
    Runtime refuses the lowered graph; ``proto`` is then partly changed and must be dropped.
    """
    if METADATA_KEY in {p.key for p in proto.metadata_props}:
        raise ConversionError(f"{where} is already lowered (metadata {METADATA_KEY})")
    opsets = {o.domain: o.version for o in proto.opset_import}
    fn_opset = opsets.get("", opsets.get("ai.onnx", 0))
    types = value_types(infer_shapes(_weightless(proto)))
    graph = proto.graph
    inputs = {vi.name: vi for vi in graph.input}
    outputs = {vi.name: vi for vi in graph.output}
    constants = {init.name for init in graph.initializer}  # RoPE tables among them fold (portable_config)
    configs: dict[str, dict] = {}
    new_inputs: list[tuple[int, onnx.ValueInfoProto]] = []
    new_outputs: list[tuple[int, onnx.ValueInfoProto]] = []

    folded = trailing_writes(graph)  # the expanded MLA prefill's fresh rows: written by the layer call itself

    def make_call(i: int, node: onnx.NodeProto) -> LayerCall:
        node_name = node.name or f"{OP_TYPE}_{i}"
        try:
            call = layer_call(node, types, fn_opset, folded, constants=constants, if_free=if_free)
        except Exception as exc:  # InvalidArgument / NotImplementedByBackend: one line, with the node
            raise ConversionError(f"--portable cannot lower node {node_name}: {exc}") from None
        if call.cfg.latent and split_latent:
            _split_latent(call, node_name, inputs, outputs, new_inputs, new_outputs)
        configs.setdefault(call.cfg.function_name(), node_attributes(node))
        return call

    calls = lower_nodes(proto, make_call, types)
    if not calls:
        raise ConversionError(f"--portable: {where} has no PagedAttention node to lower")
    first = calls[0].cfg
    split = any(c.cfg.split_latent for c in calls)
    _insert_after(graph.input, new_inputs)
    _insert_after(graph.output, new_outputs)
    dropped = _drop_unread_inputs(graph) if if_free else ()
    info = PortableInfo(
        nodes=len(calls),
        kv_cache_layout="LATENT" if first.latent else "SEPARATE",
        split_latent=split,
        num_heads=first.num_heads,
        kv_num_heads=first.kv_num_heads,
        head_size=first.head_size,
        cache_head_size=first.head_size // 2 if split else first.head_size,
        configs=tuple(configs.values()),
        if_free=if_free,
        dropped_inputs=dropped,
    )
    props = {p.key: p.value for p in proto.metadata_props}
    props.update({METADATA_KEY: info.to_json(), MIN_ONNXRUNTIME_KEY: min_onnxruntime(fn_opset)})
    helper.set_model_props(proto, props)
    if check_session:
        _check_session(proto, where)
    return info


def _split_latent(
    call: LayerCall,
    where: str,
    inputs: dict[str, onnx.ValueInfoProto],
    outputs: dict[str, onnx.ValueInfoProto],
    new_inputs: list[tuple[int, onnx.ValueInfoProto]],
    new_outputs: list[tuple[int, onnx.ValueInfoProto]],
) -> None:
    """Make ``call`` read and write its latent cache as two halves: the key cache's graph input and output shrink
    to ``H/2`` and get a ``.value`` twin each (recorded in ``new_inputs`` / ``new_outputs``)."""
    cfg, node = call.cfg, call.node
    if cfg.head_size % 2 or cfg.k_quant != "NONE":
        raise ConversionError(
            f"--portable cannot split the latent cache of node {where}: expected an even latent width and "
            f"a float cache, found width {cfg.head_size} and k_quant {cfg.k_quant}"
        )
    key_in = node.input[PAGED_ATTENTION.input_index("key_cache")]
    key_out = call.outputs[1] if len(call.outputs) > 1 else ""  # a folded trailing write's output
    if key_in not in inputs or key_out not in outputs:
        raise ConversionError(
            f"--portable cannot split the latent cache of node {where}: expected its key cache to be a "
            f"graph input and key_cache_out a graph output, found {key_in!r} / {key_out!r}"
        )
    value_in, value_out = _value_name(key_in), _value_name(key_out)
    half = cfg.head_size // 2
    for table, name, new_name, bucket in (
        (inputs, key_in, value_in, new_inputs),
        (outputs, key_out, value_out, new_outputs),
    ):
        vi = table[name]
        vi.type.tensor_type.shape.dim[3].dim_value = half
        twin = onnx.ValueInfoProto()
        twin.CopyFrom(vi)
        twin.name = new_name
        bucket.append((list(table).index(name), twin))
    ki = cfg.present_inputs.index("key_cache")
    call.cfg = dataclasses.replace(
        cfg,
        split_latent=True,
        present_inputs=(*cfg.present_inputs[: ki + 1], "value_cache", *cfg.present_inputs[ki + 1 :]),
        present_outputs=("output", "key_cache_out", "value_cache_out"),
    )
    call.inputs.insert(ki + 1, value_in)
    call.outputs = [node.output[0], key_out, value_out]


def _drop_unread_inputs(graph: onnx.GraphProto) -> tuple[str, ...]:
    """Remove the graph inputs no node reads (``attention_metadata``: the lowering ignores it); their names.

    The OpenVINO EP (onnxruntime-openvino 1.24) binds a compiled graph's inputs by position after OpenVINO has
    dropped those nothing reads, so one unread input hands every later input the wrong tensor (an error at the
    first run). A runtime feeds only the inputs the file declares (docs/converted_model.md)."""
    read = {i for node in graph.node for i in node.input} | {o.name for o in graph.output}
    for node in graph.node:  # values a subgraph reads from the main graph
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                read |= {i for n in sub.node for i in n.input}
    unread = [vi for vi in graph.input if vi.name not in read]
    for vi in unread:
        graph.input.remove(vi)
    return tuple(vi.name for vi in unread)


def _value_name(key_name: str) -> str:
    """``past_key_values.{i}.key`` -> ``past_key_values.{i}.value``; ``present.{i}.key`` -> ``.value``."""
    if key_name.endswith(".key"):
        return key_name[: -len(".key")] + ".value"
    return key_name + ".value"


def _insert_after(field, additions: list[tuple[int, onnx.ValueInfoProto]]) -> None:
    """Each twin right after its key (inputs/outputs keep the key, value, key, value order genai expects)."""
    if not additions:
        return
    items = [onnx.ValueInfoProto() for _ in field]
    for dst, src in zip(items, field, strict=True):
        dst.CopyFrom(src)
    after = {idx: twin for idx, twin in additions}
    del field[:]
    for idx, vi in enumerate(items):
        field.append(vi)
        if idx in after:
            field.append(after[idx])


def _check_session(proto: onnx.ModelProto, where: str) -> None:
    """ONNX Runtime's CPU EP must open the lowered graph (weights as typed inputs): no custom op is left."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(_weightless(proto).SerializeToString(), opts, providers=[CPU])
    except Exception as exc:
        line = " ".join(str(exc).split())[:500]
        raise ConversionError(f"--portable: ONNX Runtime (CPU) rejects the lowered {where}: {line}") from None


def _replace(proto: onnx.ModelProto, path: Path) -> None:
    """Write next to ``path`` then rename over it: the file is the old or the new model, never half of one."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with open(tmp, "wb") as f:
            f.write(proto.SerializeToString())
        os.chmod(tmp, os.stat(path).st_mode & 0o777)  # the converted file's own mode, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
