"""The rewrite: a dense attention model -> a paged model on ``com.microsoft::PagedAttention``, graph -> graph.

:func:`rewrite` changes an ``ir.Model`` in place and nothing else (no file, no session, no verification), as an
onnxscript pass would: canonicalise cache I/O, pre-optimise (onnxscript optimizer), fold values read from static
dims, match every layer (all or nothing; MLA -> LATENT, MHA/GQA -> SEPARATE), paged I/O, one PagedAttention node per
layer, per-sequence values, optional dtype, int8 cache scales. :func:`convert` is the in-memory conversion around it:
load, rewrite, then the checks of the result (onnx.checker, every node validated, ONNX Runtime opening it on each
provider). Writing, verification and deployment are :mod:`ortpa.conversion`'s. Any failure raises
:class:`~ortpa.errors.ConversionError`; nothing half-converted is ever returned.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import onnx
import onnx_ir as ir

from ortpa.errors import ConversionError
from ortpa.model.kind import ModelKind, model_kind
from ortpa.model.ref import resolve_any
from ortpa.progress import LayerStarted, Progress, Stage, report
from ortpa.rewriter import dead_attention, kv_quant, model_store, paged_io, per_sequence
from ortpa.rewriter._fold import fold_shape_values, register_loose_constants
from ortpa.rewriter._graph import Builder
from ortpa.rewriter._optimize import optimize
from ortpa.rewriter.attention import op_constant, rewrite_attention_layer, rope_in_op_problems
from ortpa.rewriter.derived import DERIVED_KEY
from ortpa.rewriter.derived import dumps as derived_dumps
from ortpa.rewriter.dtype import convert_float_type
from ortpa.rewriter.layer import AttentionLayer, LayerFailure, MlaLayer
from ortpa.rewriter.mla import rewrite_mla_layer
from ortpa.rewriter.mla_prefill import expanded_reasons, prefill_split, register_composites
from ortpa.rewriter.options import DType, RewriteOptions
from ortpa.rewriter.ort_check import DEFAULT_PROVIDERS
from ortpa.rewriter.recognisers import recognise_separate_layers, source_op
from ortpa.rewriter.recognisers.caches import canonicalise_cache_io
from ortpa.rewriter.recognisers.mla import match_mla_layers
from ortpa.rewriter.rope import rope_caches
from ortpa.rewriter.shape_recovery import recover_shapes

__all__ = ["DEFAULT_MAX_POSITIONS", "RewriteOptions", "Spill", "convert", "options_from", "rewrite"]

Spill = Callable[[ir.Model], None]
DEFAULT_MAX_POSITIONS = 4096  # cos/sin rows when RoPE moves into the op and the model does not say otherwise
_IR_DTYPES = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}
_DTYPE_NAMES = {v: k for k, v in _IR_DTYPES.items()}


def _op_dtype(model_dtype: ir.DataType, dtype: DType | None, kv_cache_dtype: str) -> tuple[ir.DataType, str]:
    """The op's T (a float cache's element type too) and why: ``dtype`` when given, else the model's own half type,
    else (a float32 model) the asked cache dtype, else float16: the op takes no float32, and float16 is the more
    precise of its two float types."""
    if dtype is not None:
        target = _IR_DTYPES[dtype]
        if kv_cache_dtype not in ("auto", dtype):
            raise ConversionError(
                f"kv_cache_dtype {kv_cache_dtype!r} differs from dtype {dtype!r}: a float cache has the "
                "activations' type; the quantized cache ortpa supports is 'int8'"
            )
        return target, f"the converted model's dtype ({dtype})"
    if model_dtype in _IR_DTYPES.values():
        if kv_cache_dtype != "auto" and _IR_DTYPES.get(kv_cache_dtype) != model_dtype:
            raise ConversionError(f"kv_cache_dtype {kv_cache_dtype!r} differs from the model's {model_dtype.name}")
        return model_dtype, f"the model's activation dtype ({_DTYPE_NAMES[model_dtype]})"
    if kv_cache_dtype == "auto":
        return ir.DataType.FLOAT16, (
            "the model computes in float32, which PagedAttention cannot (its T is float16 or bfloat16): float16, "
            "the more precise of the two; the attention's inputs are cast to it and its output back to float32"
        )
    if kv_cache_dtype not in _IR_DTYPES:
        raise ConversionError(f"kv_cache_dtype must be 'auto', 'float16', 'bfloat16' or 'int8', got {kv_cache_dtype!r}")
    return _IR_DTYPES[kv_cache_dtype], "the cache dtype asked, for a float32 model"


def _check_layers(results: list[MlaLayer | LayerFailure]) -> list[MlaLayer]:
    if not results:
        raise ConversionError(
            "no attention layers found: expected graph inputs past_key_values.{i}.key/.value of a dense MLA export"
        )
    failures = [r for r in results if isinstance(r, LayerFailure)]
    if failures:
        raise ConversionError(
            f"{len(failures)} of {len(results)} layers are not dense MLA that ortpa can absorb; nothing was converted",
            [f.as_pair() for f in failures],
        )
    return [r for r in results if isinstance(r, MlaLayer)]


def _attention_family(
    graph: ir.Graph, mla_results: list[MlaLayer | LayerFailure]
) -> list[AttentionLayer | LayerFailure] | None:
    """MHA/GQA match results when the model is not MLA; None sends it down the MLA path.

    A model is MLA when any layer matches MLA (its failures are then MLA failures). Otherwise it is MHA/GQA when
    any layer matches that, or when no layer matches either but the key and value caches have the same shape
    (so the MHA/GQA reasons are the relevant ones).
    """
    if not mla_results or any(isinstance(r, MlaLayer) for r in mla_results):
        return None
    results = recognise_separate_layers(graph)
    if any(isinstance(r, AttentionLayer) for r in results) or any(source_op(graph, r.layer) for r in mla_results):
        return results
    key = next((v for v in graph.inputs if v.name == f"past_key_values.{mla_results[0].layer}.key"), None)
    value = next((v for v in graph.inputs if v.name == f"past_key_values.{mla_results[0].layer}.value"), None)
    if key is not None and value is not None and key.shape is not None and value.shape is not None:
        if len(key.shape) == 4 and key.shape[1] == value.shape[1] and key.shape[3] == value.shape[3]:
            return results
    return None


def _convert_separate(
    irm: ir.Model,
    results: list[AttentionLayer | LayerFailure],
    o: RewriteOptions,
    kv_cache_dtype: str,
    kv_plan: kv_quant.KVQuantPlan | None,
    progress: Progress | None,
    spill: Spill | None,
) -> None:
    """In place: every MHA/GQA layer -> one PagedAttention SEPARATE node, paged I/O, optional dtype."""
    failures = [r for r in results if isinstance(r, LayerFailure)]
    if failures:
        raise ConversionError(
            f"{len(failures)} of {len(results)} layers are not MHA/GQA attention that ortpa converts; "
            "nothing was converted",
            [f.as_pair() for f in failures],
        )
    layers = [r for r in results if isinstance(r, AttentionLayer)]
    graph = irm.graph
    op_dtype, why = _op_dtype(layers[0].query.dtype or ir.DataType.FLOAT, o.dtype, kv_cache_dtype)
    _record_cache_dtype(irm, op_dtype, why, o.kv_cache_dtype)
    cos = sin = None
    if o.rope_in_op:
        problems = [
            (f"layer {m.layer}", "; ".join(p)) for m in layers if m.rotary is None and (p := rope_in_op_problems(m))
        ]
        if problems:
            raise ConversionError("RoPE cannot move into PagedAttention (rope_in_op=True)", problems)
        report(progress, Stage.FINISH, "computing cos/sin caches from the model's RoPE")
        rows = o.max_positions or int(irm.metadata_props.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
        cos, sin = rope_caches(irm, layers[0].head_size, rows)

    report(progress, Stage.REWRITE, "building the paged interface")
    irm.opset_imports.setdefault("com.microsoft", 1)
    io = paged_io.begin(graph, attention_metadata=o.attention_metadata, position_ids=o.position_ids)
    if cos is not None:
        io.cos_cache = _const(graph, "rope.cos_cache", cos, op_dtype)
        io.sin_cache = _const(graph, "rope.sin_cache", sin, op_dtype)
    for index, m in enumerate(layers):
        heads = f"{m.num_heads} heads over {m.kv_num_heads} KV heads"
        _layer(progress, index, len(layers), m.layer, f"rewriting layer {m.layer} ({heads})")
        key_cache, value_cache = paged_io.add_separate_caches(graph, m.layer, m.kv_num_heads, m.head_size, op_dtype)
        key_out, value_out = rewrite_attention_layer(
            graph, m, key_cache, value_cache, io.op_inputs(), rope_in_op=o.rope_in_op, op_dtype=op_dtype, packed_io=io
        )
        paged_io.set_present(graph, m.layer, key_out, key_cache)
        paged_io.set_present_value(graph, m.layer, value_out, value_cache)
        if spill is not None:
            spill(irm)
    # present.{i}.key / .value next to each other, in layer order, after logits (as the inputs are ordered)
    _finish(irm, io, "paged-attention-separate", o, kv_plan, progress)


def _finish(irm: ir.Model, io, kind: str, o: RewriteOptions, kv_plan, progress: Progress | None) -> None:
    """The tail both families share: outputs and logits rows, optional whole-model dtype, int8 caches, metadata."""
    paged_io.route(irm, io)
    per_sequence.per_sequence_reductions(irm.graph, io)  # batched = alone: step-wide values -> per sequence, or refuse
    paged_io.finish(irm, io, logits=o.logits)
    if o.dtype is not None:
        report(progress, Stage.FINISH, f"converting to {o.dtype}")
        convert_float_type(irm, _IR_DTYPES[o.dtype])
    if kv_plan is not None:  # after the dtype pass: the scales must stay float32 (T_KV_SCALE)
        assert kv_plan.dense is not None
        report(progress, Stage.FINISH, "calibrating int8 KV cache scales on the dense model")
        amax = kv_quant.calibrate(kv_plan.dense, kv_plan.prompts)
        kv_quant.apply_scales(irm, amax, mode=kv_plan.mode, margin=kv_plan.margin)
    irm.metadata_props["ortpa.converted"] = kind
    irm.metadata_props["ortpa.logits"] = o.logits
    irm.metadata_props["ortpa.rope_in_op"] = str(int(o.rope_in_op))


def convert(
    model: onnx.ModelProto | ir.Model | str | os.PathLike,
    options: RewriteOptions | None = None,
    *,
    progress: Progress | None = None,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    revision: str | None = None,
    **fields,
) -> onnx.ModelProto:
    """Convert a dense model in memory: load it, :func:`rewrite` it, check the result; the checked ModelProto.

    ``options`` (or its fields as keywords: ``convert(path, dtype="float16")``) say what to make, see
    :class:`~ortpa.rewriter.options.RewriteOptions`. ``providers``: where the model is meant to run (``"cpu"``,
    ``"cuda"``): ONNX Runtime must open the converted graph on each (:mod:`ortpa.rewriter.ort_check`; CUDA where a
    device is present); ``()`` skips it. ``model`` may also be a folder or a Hugging Face repo id in the local
    cache (``revision``: branch, tag or commit), found offline by :mod:`ortpa.model.ref`.

    Nothing is written and the result is not verified against the original: :func:`ortpa.convert_file` writes a
    verified deployment, streaming the weights of models of any size.
    """
    opts = options_from(options, fields)
    model = resolve_any(model, revision)
    report(progress, Stage.LOAD, "loading")
    irm = model_store.load_ir(model)
    rewrite(irm, opts, progress=progress, source=model)
    return model_store.checked_proto(irm, progress, providers)


def options_from(options: RewriteOptions | None, fields: dict) -> RewriteOptions:
    """``options``, or the :class:`RewriteOptions` its ``fields`` spell (both at once: a TypeError)."""
    unknown = set(fields) - RewriteOptions.field_names()
    if unknown:
        known = sorted(RewriteOptions.field_names())
        raise TypeError(f"unexpected rewrite options {sorted(unknown)}; expected some of {known}")
    if options is not None and fields:
        raise TypeError("give the rewrite options as a RewriteOptions or as keywords, not both")
    return options if options is not None else RewriteOptions(**fields)


def rewrite(
    irm: ir.Model,
    options: RewriteOptions,
    *,
    progress: Progress | None = None,
    spill: Spill | None = None,
    source: object = None,
) -> ir.Model:
    """Rewrite the dense ``irm`` into the paged model, in place (graph -> graph); ``irm`` returned.

    ``spill(irm)`` runs after each layer: the caller's chance to move weights the rewrite computed out of memory
    (:meth:`ortpa.rewriter.model_store.Spill`). ``source`` names the model in messages.
    """
    o = options
    kv_plan = kv_quant.plan(
        o.kv_cache_dtype, kv_scale=o.kv_scale, margin=o.kv_scale_margin, calibration_prompts=o.calibration_prompts
    )
    kv_cache_dtype = o.kv_cache_dtype
    if kv_plan is not None:
        kv_cache_dtype = "auto"  # the op's T follows dtype / the model as for a float cache; the cache is int8
    _refuse_paged(irm, source)
    if kv_plan is not None:  # calibration runs the dense model, so keep it before the rewrite changes irm
        kv_plan.dense = model_store.inline_copy(irm)
    canonicalise_cache_io(irm.graph)  # caches found by what reads and writes them; digit-string dims as numbers
    # an attention whose output reaches nothing still writes its layer's cache: kept through the optimizer
    pinned = dead_attention.pin(irm.graph)
    report(progress, Stage.OPTIMISE, "pre-optimising (onnxscript optimizer)")
    optimize(irm)  # onnxscript's optimizer, linear in the graph (ortpa.rewriter._optimize)
    register_loose_constants(irm.graph)  # what the optimizer leaves unserializable
    fold_shape_values(irm)  # what the optimizer leaves: values read from static dims of partly symbolic shapes
    recover_shapes(irm)  # shapes the optimizer could not infer (past contrib ops): the per-sequence flow reads them
    graph = irm.graph
    report(progress, Stage.MATCH, "matching attention layers")
    mla_results = match_mla_layers(graph)
    attention_results = _attention_family(graph, mla_results)
    dead_attention.unpin(graph, pinned)  # matched: the op is rewritten like any other, its dense remains go later
    unread = [r.layer for r in attention_results or [] if isinstance(r, AttentionLayer) and r.attn_out in pinned]
    if unread:  # said, not refused: the conversion computes what the export computes (dead_attention)
        irm.metadata_props["ortpa.unread_attention_layers"] = ",".join(map(str, unread))
        report(
            progress,
            Stage.MATCH,
            f"layer(s) {unread}: the source's attention output reaches no graph output (its cache is still "
            "written; the logits do not depend on it): converted as the export computes it",
        )
    if attention_results is not None:  # MHA / GQA -> PagedAttention SEPARATE
        _convert_separate(irm, attention_results, o, kv_cache_dtype, kv_plan, progress, spill)
        return irm
    layers = _check_layers(mla_results)
    model_dtype = layers[0].q_nope.dtype or ir.DataType.FLOAT
    op_dtype, why = _op_dtype(model_dtype, o.dtype, kv_cache_dtype)
    _record_cache_dtype(irm, op_dtype, why, o.kv_cache_dtype)

    cos = sin = None
    if o.rope_in_op:
        report(progress, Stage.FINISH, "computing cos/sin caches from the model's RoPE")
        rows = o.max_positions or int(irm.metadata_props.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
        cos, sin = rope_caches(irm, layers[0].qk_rope, rows)
        bad = [m for m in layers if m.rope_interleaved is None or m.k_pe_raw is None or m.head_size % 16]
        if bad or layers[0].qk_rope % 16:
            raise ConversionError(
                "RoPE cannot move into PagedAttention (rope_in_op=True)",
                [
                    (
                        f"layer {m.layer}",
                        f"needs head_size % 16 == 0 and qk_rope % 16 == 0 (got {m.head_size}, {m.qk_rope}), "
                        f"a recognised RoPE (interleaved={m.rope_interleaved}) and k_pe before RoPE "
                        f"({'found' if m.k_pe_raw is not None else 'not found'})",
                    )
                    for m in (bad or layers)
                ],
            )

    report(progress, Stage.REWRITE, "building the paged interface")
    irm.opset_imports.setdefault("com.microsoft", 1)
    io = paged_io.begin(graph, attention_metadata=o.attention_metadata, position_ids=o.position_ids)
    if cos is not None:
        io.cos_cache = _const(graph, "rope.cos_cache", cos, op_dtype)
        io.sin_cache = _const(graph, "rope.sin_cache", sin, op_dtype)
    cache_dtype = op_dtype
    reasons = expanded_reasons(layers, rope_in_op=o.rope_in_op, int8_cache=kv_plan is not None)
    split = None
    for index, m in enumerate(layers):
        _layer(progress, index, len(layers), m.layer, f"absorbing layer {m.layer}")
        cache = paged_io.add_key_cache(graph, m.layer, m.head_size, cache_dtype)
        if o.mla_prefill == "expanded" and not reasons and split is None:
            split = prefill_split(graph, io, cache)
        out = rewrite_mla_layer(
            graph, m, cache, io.op_inputs(), rope_in_op=o.rope_in_op, absorb=o.absorb, op_dtype=op_dtype, split=split
        )
        paged_io.set_present(graph, m.layer, out, cache)
        if spill is not None:
            spill(irm)
    if split is not None:
        register_composites(io, split)
    derived = {name: entry for m in layers for name, entry in m.derived.items()}
    if derived:  # what the verification's twin rebuilds from the original's weights (ortpa.rewriter.derived)
        irm.metadata_props[DERIVED_KEY] = derived_dumps(derived)
    irm.metadata_props["ortpa.mla_prefill"] = (
        "expanded"
        if split is not None
        else "absorbed" + (f": {'; '.join(reasons)}" if reasons and o.mla_prefill == "expanded" else "")
    )
    _finish(irm, io, "paged-attention-latent", o, kv_plan, progress)
    return irm


def _record_cache_dtype(irm: ir.Model, op_dtype: ir.DataType, why: str, asked: str) -> None:
    """The KV cache's element type and why it is that (``ortpa.kv_cache_dtype``, ``..._reason``), so a user and
    the runtime read it from the model rather than guess it from the graph."""
    name = _DTYPE_NAMES[op_dtype]
    if asked == "int8":
        irm.metadata_props["ortpa.kv_cache_dtype"] = "int8"
        irm.metadata_props["ortpa.kv_cache_dtype_reason"] = f"asked (int8, static scales); the op computes in {name}"
        return
    irm.metadata_props["ortpa.kv_cache_dtype"] = name
    irm.metadata_props["ortpa.kv_cache_dtype_reason"] = f"auto: {why}" if asked == "auto" else f"asked ({asked})"


def _refuse_paged(irm: ir.Model, model) -> None:
    """A paged model given again: said as such, not as layers whose dense caches are missing."""
    kind = model_kind(irm)
    if kind is ModelKind.DENSE:
        return
    where = os.fspath(model) if isinstance(model, (str, os.PathLike)) else "the model"
    lowered = ", lowered to standard ONNX ops (--portable)" if kind is ModelKind.PORTABLE else ""
    raise ConversionError(
        f"{where} is already a paged model{lowered}: nothing to convert. Run it as it is "
        "(ortpa generate / ortpa serve), or convert its dense original (past/present KV caches)"
    )


def _layer(progress: Progress | None, index: int, total: int, layer: int, message: str) -> None:
    if progress is not None:
        progress(LayerStarted(index, total, layer, message))


def _const(graph: ir.Graph, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
    """The cos/sin tables in the op's type: float32, cast in the graph (see :func:`attention.op_constant`)."""
    return op_constant(Builder(graph, "/rope"), np.asarray(array, np.float32), name, dtype)
