"""``convert()``: a dense MLA ONNX model -> a paged model on ``com.microsoft::PagedAttention`` (LATENT).

Steps: pre-optimise (onnxscript optimizer), match every layer (all or nothing), paged I/O, absorb each layer
into one PagedAttention node, drop the dense I/O, optional dtype conversion, validate every PagedAttention
node, check that ONNX Runtime loads the graph on CPU up to the op's missing CPU kernel. Any failure raises
:class:`~ortpa.errors.ConversionError`; nothing half-converted is ever returned or written.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.optimizer

from ortpa.errors import ConversionError
from ortpa.model.ref import resolve_any
from ortpa.rewriter import kv_quant, model_store, paged_io, per_sequence
from ortpa.rewriter._fold import fold_shape_values
from ortpa.rewriter._graph import Builder
from ortpa.rewriter.attention import op_constant, rewrite_attention_layer, rope_in_op_problems
from ortpa.rewriter.dtype import convert_float_type
from ortpa.rewriter.layer import AttentionLayer, LayerFailure, MlaLayer
from ortpa.rewriter.mla import AbsorbMode, rewrite_mla_layer
from ortpa.rewriter.model_store import BeforeMove, save_model
from ortpa.rewriter.ort_check import DEFAULT_PROVIDERS
from ortpa.rewriter.recognisers import recognise_separate_layers, source_op
from ortpa.rewriter.recognisers.caches import canonicalise_cache_io
from ortpa.rewriter.recognisers.mla import match_mla_layers
from ortpa.rewriter.rope import rope_caches
from ortpa.rewriter.shape_recovery import recover_shapes

__all__ = ["DEFAULT_MAX_POSITIONS", "convert", "save_model"]

DType = Literal["float16", "bfloat16"]
DEFAULT_MAX_POSITIONS = 4096  # cos/sin rows when RoPE moves into the op and the model does not say otherwise
_IR_DTYPES = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}


def _progress(progress: Callable[[str], None] | None, message: str) -> None:
    if progress is not None:
        progress(message)


def _op_dtype(model_dtype: ir.DataType, dtype: DType | None, kv_cache_dtype: str | None) -> ir.DataType:
    """The op's T: the converted model's dtype, else the model's own half type, else the cache dtype (fp16)."""
    if dtype is not None:
        target = _IR_DTYPES[dtype]
        if kv_cache_dtype not in (None, dtype):
            raise ConversionError(
                f"kv_cache_dtype {kv_cache_dtype!r} differs from dtype {dtype!r}: a float cache has the "
                "activations' type; the quantized cache ortpa supports is 'int8'"
            )
        return target
    if model_dtype in _IR_DTYPES.values():
        if kv_cache_dtype is not None and _IR_DTYPES.get(kv_cache_dtype) != model_dtype:
            raise ConversionError(f"kv_cache_dtype {kv_cache_dtype!r} differs from the model's {model_dtype.name}")
        return model_dtype
    if kv_cache_dtype is None:
        return ir.DataType.FLOAT16
    if kv_cache_dtype not in _IR_DTYPES:
        raise ConversionError(f"kv_cache_dtype must be None, 'float16', 'bfloat16' or 'int8', got {kv_cache_dtype!r}")
    return _IR_DTYPES[kv_cache_dtype]


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
    *,
    dtype: DType | None,
    rope_in_op: bool,
    logits: paged_io.LogitsMode,
    kv_cache_dtype: str | None,
    attention_metadata: bool,
    position_ids: paged_io.PositionMode,
    max_positions: int | None,
    progress: Callable[[str], None] | None,
    sink: model_store.Sink | None,
    kv_plan: kv_quant.KVQuantPlan | None = None,
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
    op_dtype = _op_dtype(layers[0].query.dtype or ir.DataType.FLOAT, dtype, kv_cache_dtype)
    cos = sin = None
    if rope_in_op:
        problems = [
            (f"layer {m.layer}", "; ".join(p)) for m in layers if m.rotary is None and (p := rope_in_op_problems(m))
        ]
        if problems:
            raise ConversionError("RoPE cannot move into PagedAttention (rope_in_op=True)", problems)
        _progress(progress, "computing cos/sin caches from the model's RoPE")
        rows = max_positions or int(irm.metadata_props.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
        cos, sin = rope_caches(irm, layers[0].head_size, rows)

    _progress(progress, "building the paged interface")
    irm.opset_imports.setdefault("com.microsoft", 1)
    io = paged_io.begin(graph, attention_metadata=attention_metadata, position_ids=position_ids)
    if cos is not None:
        io.cos_cache = _const(graph, "rope.cos_cache", cos, op_dtype)
        io.sin_cache = _const(graph, "rope.sin_cache", sin, op_dtype)
    for m in layers:
        _progress(progress, f"rewriting layer {m.layer} ({m.num_heads} heads over {m.kv_num_heads} KV heads)")
        key_cache, value_cache = paged_io.add_separate_caches(graph, m.layer, m.kv_num_heads, m.head_size, op_dtype)
        key_out, value_out = rewrite_attention_layer(
            graph, m, key_cache, value_cache, io.op_inputs(), rope_in_op=rope_in_op, op_dtype=op_dtype, packed_io=io
        )
        paged_io.set_present(graph, m.layer, key_out, key_cache)
        paged_io.set_present_value(graph, m.layer, value_out, value_cache)
        model_store.after_layer(irm, sink)
    # present.{i}.key / .value next to each other, in layer order, after logits (as the inputs are ordered)
    _finish(
        irm,
        io,
        "paged-attention-separate",
        logits=logits,
        dtype=dtype,
        rope_in_op=rope_in_op,
        progress=progress,
        kv_plan=kv_plan,
    )


def _finish(irm: ir.Model, io, kind: str, *, logits, dtype, rope_in_op: bool, progress, kv_plan=None) -> None:
    """The tail both families share: outputs and logits rows, optional whole-model dtype, int8 caches, metadata."""
    paged_io.route(irm, io)
    per_sequence.per_sequence_reductions(irm.graph, io)  # batched = alone: step-wide values -> per sequence, or refuse
    paged_io.finish(irm, io, logits=logits)
    if dtype is not None:
        _progress(progress, f"converting to {dtype}")
        convert_float_type(irm, _IR_DTYPES[dtype])
    if kv_plan is not None:  # after the dtype pass: the scales must stay float32 (T_KV_SCALE)
        assert kv_plan.dense is not None
        _progress(progress, "calibrating int8 KV cache scales on the dense model")
        amax = kv_quant.calibrate(kv_plan.dense, kv_plan.prompts)
        kv_quant.apply_scales(irm, amax, mode=kv_plan.mode, margin=kv_plan.margin)
    irm.metadata_props["ortpa.converted"] = kind
    irm.metadata_props["ortpa.logits"] = logits
    irm.metadata_props["ortpa.rope_in_op"] = str(int(rope_in_op))


def convert(
    model: onnx.ModelProto | ir.Model | str | os.PathLike,
    out_path: str | os.PathLike | None = None,
    *,
    dtype: DType | None = None,
    rope_in_op: bool = False,
    logits: paged_io.LogitsMode = "last",
    kv_cache_dtype: str | None = None,
    absorb: AbsorbMode = "auto",
    attention_metadata: bool = True,
    position_ids: paged_io.PositionMode = "derive",
    max_positions: int | None = None,
    progress: Callable[[str], None] | None = None,
    providers: Sequence[str] = DEFAULT_PROVIDERS,
    kv_scale: kv_quant.KVScaleMode = "per-channel",
    kv_scale_margin: float = kv_quant.DEFAULT_MARGIN,
    calibration_prompts: Sequence[Sequence[int]] | None = None,
    revision: str | None = None,
    before_move: BeforeMove | None = None,
) -> onnx.ModelProto:
    """Convert a dense MLA model (DeepSeek-V2/V3 style export with past/present KV) to PagedAttention LATENT.

    * ``dtype``: convert the whole model to float16/bfloat16; ``None`` keeps its precision and casts to the op's
      half type (``kv_cache_dtype``, default float16) at the attention boundary.
    * ``rope_in_op``: False (default) keeps the model's own RoPE in the graph (``do_rotary=0``); True moves it
      into the op (``do_rotary=1``, ``rotary_offset=kv_lora_rank``, cos/sin caches of ``max_positions`` rows).
    * ``logits``: ``"last"`` = one row per sequence (its last new token), ``"all"`` = one row per packed token.
    * ``absorb``: ``"auto"`` folds W_UK / W_UV into q_proj / o_proj when that is exact and not larger,
      ``"fold"`` always folds where exact, ``"matmul"`` never folds (per-head MatMuls, as vLLM does).
    * ``kv_cache_dtype="int8"``: int8 caches with static scales (``kv_scale`` per-channel or per-tensor, times
      ``kv_scale_margin``) calibrated by running the dense model on ``calibration_prompts`` (token-id lists;
      default: seeded random prompts); see :mod:`ortpa.rewriter.kv_quant`. float8e4m3fn is rejected.
    * ``providers``: where the written model is meant to run (``"cpu"``, ``"cuda"``): ONNX Runtime must open the
      converted graph on each (:mod:`ortpa.rewriter.ort_check`; CUDA where a device is present); ``()`` skips it.
    * ``model`` may also be a folder or a Hugging Face repo id in the local cache (``revision``: branch, tag or
      commit), found offline by :mod:`ortpa.model.ref`.
    * ``out_path``: stream the converted model to this file (and ``<out_path>.data``) through a temp folder next
      to it, checked from the written files, then moved into place: complete or absent. ``before_move(tmp)`` runs
      on the checked temp model before the move (the verification of :func:`ortpa.convert_file`); it raises to
      stop the write or returns metadata entries to stamp in. Without ``out_path`` the result is in memory and
      nothing is written (``before_move`` must then be None).

    This is the rewriter alone: :func:`ortpa.convert_file` adds the verification against the original.
    """
    model = resolve_any(model, revision)
    if out_path is None:
        if before_move is not None:
            raise ValueError("before_move needs out_path: it runs on the written model")
        return _convert(model, None, before_move=None, **_opts(locals()))
    if isinstance(model, (str, os.PathLike)) and Path(model).resolve() == Path(out_path).resolve():
        raise ConversionError("refusing to overwrite the input model", [("out_path", str(out_path))])
    if Path(out_path).is_dir():  # found before the work, not after it
        raise ConversionError(f"cannot write {os.fspath(out_path)}: it is a directory")
    with model_store.writing_to(out_path, progress) as sink:
        if isinstance(model, (str, os.PathLike)):
            sink.inputs = frozenset({Path(model).resolve()})
        return _convert(model, sink, before_move=before_move, **_opts(locals()))


_OPTIONS = (
    "dtype rope_in_op logits kv_cache_dtype absorb attention_metadata position_ids max_positions progress "
    "providers kv_scale kv_scale_margin calibration_prompts"
).split()


def _opts(names: dict) -> dict:
    return {k: names[k] for k in _OPTIONS}


def _convert(
    model,
    sink: model_store.Sink | None,
    *,
    before_move: BeforeMove | None,
    dtype: DType | None,
    rope_in_op: bool,
    logits: paged_io.LogitsMode,
    kv_cache_dtype: str | None,
    absorb: AbsorbMode,
    attention_metadata: bool,
    position_ids: paged_io.PositionMode,
    max_positions: int | None,
    progress: Callable[[str], None] | None,
    providers: Sequence[str],
    kv_scale: kv_quant.KVScaleMode,
    kv_scale_margin: float,
    calibration_prompts: Sequence[Sequence[int]] | None,
) -> onnx.ModelProto:
    kv_plan = kv_quant.plan(
        kv_cache_dtype, kv_scale=kv_scale, margin=kv_scale_margin, calibration_prompts=calibration_prompts
    )
    if kv_plan is not None:
        kv_cache_dtype = None  # the op's T follows dtype / the model as for a float cache; the cache is int8
    _progress(progress, "loading")
    irm = model_store.load_ir(model, sink)
    if kv_plan is not None:  # calibration runs the dense model, so keep it before the rewrite changes irm
        kv_plan.dense = model_store.inline_copy(irm)
    canonicalise_cache_io(irm.graph)  # caches found by what reads and writes them; digit-string dims as numbers
    _progress(progress, "pre-optimising (onnxscript optimizer)")
    onnxscript.optimizer.optimize(irm)
    fold_shape_values(irm)  # what the optimizer leaves: values read from static dims of partly symbolic shapes
    recover_shapes(irm)  # shapes the optimizer could not infer (past contrib ops): the per-sequence flow reads them
    graph = irm.graph
    _progress(progress, "matching MLA layers")
    mla_results = match_mla_layers(graph)
    attention_results = _attention_family(graph, mla_results)
    if attention_results is not None:  # MHA / GQA -> PagedAttention SEPARATE
        _convert_separate(
            irm,
            attention_results,
            dtype=dtype,
            rope_in_op=rope_in_op,
            logits=logits,
            kv_cache_dtype=kv_cache_dtype,
            attention_metadata=attention_metadata,
            position_ids=position_ids,
            max_positions=max_positions,
            progress=progress,
            sink=sink,
            kv_plan=kv_plan,
        )
        return model_store.finish(irm, sink, progress, providers, before_move)
    layers = _check_layers(mla_results)
    model_dtype = layers[0].q_nope.dtype or ir.DataType.FLOAT
    op_dtype = _op_dtype(model_dtype, dtype, kv_cache_dtype)

    cos = sin = None
    if rope_in_op:
        _progress(progress, "computing cos/sin caches from the model's RoPE")
        rows = max_positions or int(irm.metadata_props.get("max_position_embeddings", DEFAULT_MAX_POSITIONS))
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

    _progress(progress, "building the paged interface")
    irm.opset_imports.setdefault("com.microsoft", 1)
    io = paged_io.begin(graph, attention_metadata=attention_metadata, position_ids=position_ids)
    if cos is not None:
        io.cos_cache = _const(graph, "rope.cos_cache", cos, op_dtype)
        io.sin_cache = _const(graph, "rope.sin_cache", sin, op_dtype)
    cache_dtype = op_dtype
    for m in layers:
        _progress(progress, f"absorbing layer {m.layer}")
        cache = paged_io.add_key_cache(graph, m.layer, m.head_size, cache_dtype)
        out = rewrite_mla_layer(
            graph, m, cache, io.op_inputs(), rope_in_op=rope_in_op, absorb=absorb, op_dtype=op_dtype
        )
        paged_io.set_present(graph, m.layer, out, cache)
        model_store.after_layer(irm, sink)
    _finish(
        irm,
        io,
        "paged-attention-latent",
        logits=logits,
        dtype=dtype,
        rope_in_op=rope_in_op,
        progress=progress,
        kv_plan=kv_plan,
    )
    return model_store.finish(irm, sink, progress, providers, before_move)


def _const(graph: ir.Graph, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
    """The cos/sin tables in the op's type: float32, cast in the graph (see :func:`attention.op_constant`)."""
    return op_constant(Builder(graph, "/rope"), np.asarray(array, np.float32), name, dtype)
