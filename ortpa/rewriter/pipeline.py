"""``convert()``: a dense MLA ONNX model -> a paged model on ``com.microsoft::PagedAttention`` (LATENT).

Steps: pre-optimise (onnxscript optimizer), match every layer (all or nothing), paged I/O, absorb each layer
into one PagedAttention node, drop the dense I/O, optional dtype conversion, validate every PagedAttention
node, check that ONNX Runtime loads the graph on CPU up to the op's missing CPU kernel. Any failure raises
:class:`~ortpa.errors.ConversionError`; nothing half-converted is ever returned or written.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.optimizer

from ortpa.errors import ConversionError, InvalidModel
from ortpa.model_file import read_model
from ortpa.model_ref import ModelRef, companion_files, copy_companion_files, locate_model, resolve_any
from ortpa.rewriter import kv_quant, paged_io
from ortpa.rewriter.attention import AttentionLayer, rewrite_attention_layer, rope_in_op_problems
from ortpa.rewriter.dtype import convert_float_type
from ortpa.rewriter.mla import AbsorbMode, LayerFailure, MlaLayer, match_mla_layers, rewrite_mla_layer
from ortpa.rewriter.recognisers import recognise_separate_layers, source_op
from ortpa.rewriter.recognisers.caches import canonicalise_cache_io
from ortpa.rewriter.rope import rope_caches

__all__ = ["DEFAULT_MAX_POSITIONS", "convert", "convert_file"]

DType = Literal["float16", "bfloat16"]
DEFAULT_MAX_POSITIONS = 4096  # cos/sin rows when RoPE moves into the op and the model does not say otherwise
_EXTERNAL_DATA_THRESHOLD = 2**31 - 2**20  # protobuf's 2 GB limit, with headroom for the graph itself
_IR_DTYPES = {"float16": ir.DataType.FLOAT16, "bfloat16": ir.DataType.BFLOAT16}


def _progress(progress: Callable[[str], None] | None, message: str) -> None:
    if progress is not None:
        progress(message)


def _to_ir(model: onnx.ModelProto | ir.Model | str | os.PathLike) -> ir.Model:
    """A private ir.Model: the caller's model object is never modified.

    Files and ModelProtos go through the shared loader (:func:`ortpa.model_file.read_model`), which checks
    external data and reads it in: onnx_ir's lazy external tensors would stay references to the input's
    folder, which the serialized result cannot resolve (onnx.checker and ORT would look in the working
    directory). The input must also pass onnx.checker, which the converted model has to pass anyway: a model
    it rejects would otherwise fail somewhere deep in the optimizer with an unrelated message.
    """
    if isinstance(model, ir.Model):  # the caller's own in-memory object: a private copy, as before
        return ir.serde.deserialize_model(ir.serde.serialize_model(model))
    if not isinstance(model, (onnx.ModelProto, str, os.PathLike)):
        raise TypeError(f"expected onnx.ModelProto, onnx_ir.Model or a path, got {type(model).__name__}")
    loaded = read_model(model)
    try:
        onnx.checker.check_model(loaded.proto, full_check=False)
    except onnx.checker.ValidationError as exc:
        reason = " ".join(str(exc).split())
        raise InvalidModel(loaded.label, f"fails onnx.checker: {reason[:500]}") from None
    except ValueError:  # over 2 GB in memory: the checker needs a path; ONNX Runtime checks it at the end
        pass
    return ir.serde.deserialize_model(loaded.proto)


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


def _validate(proto: onnx.ModelProto) -> None:
    """Every PagedAttention node against ONNX Runtime's rules (ortpa.ops.validate), for the CUDA backend."""
    from ortpa.ops.validate import validate_model

    report = validate_model(proto, backend="cuda")
    if not report.ok:
        raise ConversionError("the converted model has invalid PagedAttention nodes", _report_pairs(report))


def _report_pairs(report) -> list[tuple[str, str]]:
    """(node, problem) pairs from an ortpa.ops.validate report: rule errors and backend gaps."""
    pairs = []
    for node in getattr(report, "nodes", ()):
        pairs += [(node.node, f"[{rule}] {name}: {msg}") for rule, name, msg in node.errors]
        pairs += [(node.node, f"not implemented by {b}: {f}: {d}") for b, f, d in node.backend_errors]
    return pairs or [("model", report.format() if hasattr(report, "format") else str(report))]


def _check_session(proto: onnx.ModelProto) -> None:
    """ORT on CPU must get as far as kernel lookup and fail only on PagedAttention's missing CPU kernel."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        ort.InferenceSession(proto.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    except Exception as exc:
        text = str(exc)
        if "NOT_IMPLEMENTED" in text and ("PagedAttention" in text or "Could not find an implementation" in text):
            # kernel lookup runs after the whole graph resolved: a missing CPU kernel (PagedAttention's, or any
            # bfloat16 kernel the CPU EP lacks) is the same verdict for the graph
            return
        # The CPU EP finds no PagedAttention kernel for float16 and wraps the node in float32 Casts
        # (InsertCastTransformer), which the op's type constraint then rejects: the same "no CPU kernel" verdict,
        # reached after the whole graph resolved.
        if "InsertedPrecisionFreeCast" in text and "PagedAttention" in text:
            return
        raise ConversionError("ONNX Runtime rejects the converted model", [("session (CPU)", text[:2000])]) from exc
    raise ConversionError(
        "ONNX Runtime loaded the converted model on CPU; expected NOT_IMPLEMENTED for PagedAttention",
        [("session (CPU)", "no PagedAttention node reached kernel lookup")],
    )


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
            graph, m, key_cache, value_cache, io.op_inputs(), rope_in_op=rope_in_op, op_dtype=op_dtype
        )
        paged_io.set_present(graph, m.layer, key_out, key_cache)
        paged_io.set_present_value(graph, m.layer, value_out, value_cache)
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
    check_session: bool = True,
    kv_scale: kv_quant.KVScaleMode = "per-channel",
    kv_scale_margin: float = kv_quant.DEFAULT_MARGIN,
    calibration_prompts: Sequence[Sequence[int]] | None = None,
    revision: str | None = None,
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
    * ``model`` may also be a folder or a Hugging Face repo id in the local cache (``revision``: branch, tag or
      commit), found offline by :mod:`ortpa.model_ref`.
    """
    model = resolve_any(model, revision)
    kv_plan = kv_quant.plan(
        kv_cache_dtype, kv_scale=kv_scale, margin=kv_scale_margin, calibration_prompts=calibration_prompts
    )
    if kv_plan is not None:
        kv_cache_dtype = None  # the op's T follows dtype / the model as for a float cache; the cache is int8
    _progress(progress, "loading")
    irm = _to_ir(model)
    if kv_plan is not None:  # calibration runs the dense model, so keep it before the rewrite changes irm
        kv_plan.dense = ir.serde.serialize_model(irm)
    canonicalise_cache_io(irm.graph)  # caches found by what reads and writes them; digit-string dims as numbers
    _progress(progress, "pre-optimising (onnxscript optimizer)")
    onnxscript.optimizer.optimize(irm)
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
            kv_plan=kv_plan,
        )
        return _serialize_checked(irm, progress, check_session)
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
    return _serialize_checked(irm, progress, check_session)


def _serialize_checked(irm: ir.Model, progress: Callable[[str], None] | None, check_session: bool) -> onnx.ModelProto:
    """Serialize, then onnx.checker, ortpa's node validation and (optionally) ORT's session check."""
    proto = ir.serde.serialize_model(irm)
    _progress(progress, "checking")
    try:
        onnx.checker.check_model(proto, full_check=False)
    except Exception as exc:
        raise ConversionError("the converted model fails onnx.checker", [("model", str(exc)[:2000])]) from exc
    _validate(proto)
    if check_session:
        _check_session(proto)
    _progress(progress, "done")
    return proto


def _const(graph: ir.Graph, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.Value:
    tensor = ir.tensor(array.astype(dtype.numpy()), name=name)
    value = ir.Value(name=name, shape=ir.Shape(array.shape), type=ir.TensorType(dtype), const_value=tensor)
    graph.register_initializer(value)
    return value


def save_model(proto: onnx.ModelProto, out_path: str | os.PathLike) -> None:
    """Write atomically: a temp file next to the target, then os.replace; external data when over 2 GB."""
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    big = proto.ByteSize() > _EXTERNAL_DATA_THRESHOLD
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    os.close(fd)
    data_name = out.name + ".data"
    tmp_data = None
    try:
        if big:
            tmp_data = Path(tmp).name + ".data"
            onnx.save_model(proto, tmp, save_as_external_data=True, all_tensors_to_one_file=True, location=tmp_data)
            # the external file name is recorded inside the model: rewrite it to the final name before the move
            written = onnx.load(tmp, load_external_data=False)
            for tensor in _external_tensors(written):
                for entry in tensor.external_data:
                    if entry.key == "location":
                        entry.value = data_name
            onnx.save_model(written, tmp)
            os.replace(out.parent / tmp_data, out.parent / data_name)
        else:
            onnx.save_model(proto, tmp)
        os.replace(tmp, out)
    except BaseException:
        for leftover in (tmp, out.parent / tmp_data if tmp_data else None):
            if leftover and os.path.exists(leftover):
                os.unlink(leftover)
        raise


def _external_tensors(proto: onnx.ModelProto):
    for init in proto.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            yield init


def convert_file(
    in_path: str | os.PathLike | ModelRef, out_path: str | os.PathLike, revision: str | None = None, **options
) -> onnx.ModelProto:
    """:func:`convert` a model file; the input is never modified; the output is written atomically.

    ``in_path`` may be a folder or a Hugging Face repo id in the local cache (:mod:`ortpa.model_ref`); the
    tokenizer and config files of such a model's folder are then copied beside ``out_path``, as regular files.
    """
    ref = locate_model(in_path, revision)
    # a plain file keeps the caller's spelling, which the loader's messages name
    in_path = in_path if isinstance(in_path, (str, os.PathLike)) and ref.path == Path(in_path) else ref.path
    companions = companion_files(ref.folder) if ref.folder is not None else []  # refused before the work
    if Path(in_path).resolve() == Path(out_path).resolve():
        raise ConversionError("refusing to overwrite the input model", [("out_path", str(out_path))])
    if Path(out_path).is_dir():  # found before the work, not after it
        raise ConversionError(f"cannot write {os.fspath(out_path)}: it is a directory")
    proto = convert(in_path, **options)
    try:
        save_model(proto, out_path)  # removes its temp files on failure
    except OSError as exc:
        raise ConversionError(f"cannot write {os.fspath(out_path)}: {exc.strerror or exc}") from exc
    copy_companion_files(companions, Path(out_path).parent)
    return proto
