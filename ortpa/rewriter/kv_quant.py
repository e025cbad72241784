"""int8 KV caches for converted models: static scales from calibration, wired into every PagedAttention node.

PagedAttention quantizes symmetrically with no zero point (reference §3.4(c)): the cache write stores
``q = rint(clamp(x / s, -128, 127))`` and attention reads ``x = q * s``, with ``s`` from the float32 inputs
``k_scale`` / ``v_scale`` (14 / 15): one element for ``PER_TENSOR``, ``(kv_num_heads, 1, head_size)`` for
``PER_CHANNEL``. LATENT (MLA) has no value cache: its values are the leading channels of the key row, so only
``k_scale`` is set and it covers both.

The scales are static, so they come from calibration: the dense input model runs in ONNX Runtime on a few
prompts, and per layer the absolute maximum of what the paged cache will hold is collected. The dense
``present.{i}.key`` / ``.value`` outputs are exactly that content: for MHA/GQA the post-RoPE (post-QK-norm)
keys and the values, which the op writes unchanged into ``key_cache`` / ``value_cache``; for MLA the cached row
is ``[latent | k_pe]`` (:mod:`ortpa.rewriter.mla`), i.e. ``present.{i}.key`` (the normalised latent) followed
by ``present.{i}.value`` (the rotated k_pe). ``scale = amax * margin / 127``: the margin leaves headroom for
activations larger than calibration saw (those clamp to ±127 steps); a channel calibration never saw non-zero
gets a tiny positive scale, so it quantizes (almost) to zero rather than dividing by zero.

Default prompts are seeded random token ids (no network, no data set): they exercise every position and every
layer, but real text can produce larger activations; pass ``calibration_prompts`` (token ids) from the
deployment's own traffic for production. float8 (e4m3fn) caches are rejected: ortpa's portable op lowers
PagedAttention to standard ONNX, whose Gather/ScatterND have no float8 form, so such a model could not be run
or tested here.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import onnx
import onnx_ir as ir

from ortpa.errors import ConversionError
from ortpa.providers import CPU

__all__ = [
    "DEFAULT_MARGIN",
    "KVQuantPlan",
    "KVScaleMode",
    "LayerAmax",
    "apply_scales",
    "calibrate",
    "default_calibration_prompts",
    "plan",
    "scales_for_layer",
]

KVScaleMode = Literal["per-channel", "per-tensor"]
DEFAULT_MARGIN = 1.25
_QMAX = 127.0
_MIN_SCALE = 1e-8  # for channels calibration saw only as zero: finite 1/s, and anything stored there is ~0
_DEFAULT_PROMPTS, _DEFAULT_PROMPT_LEN, _DEFAULT_SEED = 16, 64, 0
_QUANT_TYPE = {"per-channel": "PER_CHANNEL", "per-tensor": "PER_TENSOR"}
_EXTERNAL_DATA_THRESHOLD = 2**31 - 2**20  # InferenceSession from bytes is bound by protobuf's 2 GB


@dataclass(frozen=True)
class LayerAmax:
    """Per layer ``|x|`` maxima over the calibration tokens, per ``[kv_head, channel]`` of the dense present."""

    key: np.ndarray  # [kv_heads, key_width]
    value: np.ndarray  # [kv_heads, value_width]


@dataclass
class KVQuantPlan:
    """What the caller asked for, plus the dense model to calibrate on (captured before the rewrite)."""

    mode: KVScaleMode = "per-channel"
    margin: float = DEFAULT_MARGIN
    prompts: list[list[int]] | None = None
    dense: onnx.ModelProto | None = field(default=None, repr=False)


def plan(
    kv_cache_dtype: str | None,
    *,
    kv_scale: str = "per-channel",
    margin: float = DEFAULT_MARGIN,
    calibration_prompts: Sequence[Sequence[int]] | None = None,
) -> KVQuantPlan | None:
    """A plan for a quantized cache dtype, None for a float one; reject what the converter cannot produce."""
    if kv_cache_dtype == "float8e4m3fn":
        raise ConversionError(
            "kv_cache_dtype 'float8e4m3fn' is not supported: ortpa lowers PagedAttention to standard ONNX to run "
            "and test it, and ONNX Gather/ScatterND have no float8 form; use kv_cache_dtype='int8' "
            "(or float16/bfloat16)"
        )
    if kv_cache_dtype != "int8":
        if calibration_prompts is not None:
            raise ConversionError(
                f"calibration_prompts only apply to a quantized cache (kv_cache_dtype='int8'), "
                f"got kv_cache_dtype={kv_cache_dtype!r}"
            )
        return None
    if kv_scale not in _QUANT_TYPE:
        raise ConversionError(f"kv_scale must be 'per-channel' or 'per-tensor', got {kv_scale!r}")
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin >= 1.0):
        raise ConversionError(f"the KV scale margin must be a finite number >= 1, got {margin!r}")
    prompts = None
    if calibration_prompts is not None:
        prompts = [[int(t) for t in p] for p in calibration_prompts]
        if not prompts or any(not p for p in prompts):
            raise ConversionError("calibration_prompts must be a non-empty list of non-empty token-id lists")
    return KVQuantPlan(mode=kv_scale, margin=float(margin), prompts=prompts)  # type: ignore[arg-type]


def default_calibration_prompts(
    vocab: int, count: int = _DEFAULT_PROMPTS, length: int = _DEFAULT_PROMPT_LEN, seed: int = _DEFAULT_SEED
) -> list[list[int]]:
    """``count`` seeded random prompts of ``length`` token ids in ``[0, vocab)``."""
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(count)]


def _session(dense: onnx.ModelProto):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    cpu = [CPU]
    if dense.ByteSize() < _EXTERNAL_DATA_THRESHOLD:
        return ort.InferenceSession(dense.SerializeToString(), opts, providers=cpu)
    with tempfile.TemporaryDirectory(prefix="ortpa-calib-") as tmp:  # ORT reads the weights in at load
        path = Path(tmp) / "dense.onnx"
        onnx.save_model(dense, path, save_as_external_data=True, location="dense.onnx.data")
        return ort.InferenceSession(str(path), opts, providers=cpu)


def _vocab(sess) -> int | None:
    for out in sess.get_outputs():
        if out.name == "logits" and out.shape and isinstance(out.shape[-1], int):
            return int(out.shape[-1])
    return None


def calibrate(dense: onnx.ModelProto, prompts: Sequence[Sequence[int]] | None = None) -> dict[int, LayerAmax]:
    """Run the dense model (ORT, CPU) on each prompt as one prefill; per layer ``|present|`` maxima per channel."""
    try:
        sess = _session(dense)
    except Exception as exc:
        raise ConversionError(
            "int8 KV calibration: ONNX Runtime cannot run the dense model on CPU", [("session", str(exc)[:1000])]
        ) from exc
    vocab = _vocab(sess)
    if prompts is None:
        if vocab is None:
            raise ConversionError(
                "int8 KV calibration: the dense model's logits have no static vocabulary size, so default "
                "prompts cannot be drawn; pass calibration_prompts (token ids)"
            )
        prompts = default_calibration_prompts(vocab)
    bad = [t for p in prompts for t in p if t < 0 or (vocab is not None and t >= vocab)]
    if bad:
        raise ConversionError(f"calibration_prompts: token ids must be in [0, {vocab}), found {bad[0]}")
    inputs = {i.name: i for i in sess.get_inputs()}
    outputs = [o.name for o in sess.get_outputs()]
    layers = sorted(int(n.split(".")[1]) for n in inputs if n.startswith("past_key_values.") and n.endswith(".key"))
    amax: dict[int, LayerAmax] = {}
    for ids in prompts:
        feed = _feed(inputs, list(ids))
        try:
            got = dict(zip(outputs, sess.run(None, feed), strict=True))
        except Exception as exc:
            raise ConversionError(
                "int8 KV calibration: the dense model failed on a calibration prompt",
                [(f"prompt of {len(ids)} tokens", str(exc)[:1000])],
            ) from exc
        for i in layers:
            k, v = (
                np.abs(np.asarray(got[f"present.{i}.{kind}"], np.float32)).max(axis=(0, 2)) for kind in ("key", "value")
            )
            seen = amax.get(i)
            amax[i] = LayerAmax(k, v) if seen is None else LayerAmax(np.maximum(seen.key, k), np.maximum(seen.value, v))
    if not amax:
        raise ConversionError("int8 KV calibration: the dense model has no past_key_values.{i}.key inputs")
    return amax


def _feed(inputs: dict, ids: list[int]) -> dict[str, np.ndarray]:
    from ortpa.runtime.ortvalues import numpy_dtype_for_onnx

    n = len(ids)
    feed: dict[str, np.ndarray] = {}
    for name, meta in inputs.items():
        if name == "input_ids":
            feed[name] = np.array([ids], np.int64)
        elif name == "attention_mask":
            feed[name] = np.ones((1, n), np.int64)
        elif name == "position_ids":
            feed[name] = np.arange(n, dtype=np.int64)[None]
        elif name.startswith("past_key_values.") and len(meta.shape) == 4:
            heads, width = meta.shape[1], meta.shape[3]
            if not (isinstance(heads, int) and isinstance(width, int)):
                raise ConversionError(
                    f"int8 KV calibration: expected static heads and width on {name}, got {meta.shape}"
                )
            feed[name] = np.zeros((1, heads, 0, width), numpy_dtype_for_onnx(meta.type))
        else:
            raise ConversionError(
                "int8 KV calibration: expected dense inputs input_ids, attention_mask, position_ids and "
                f"past_key_values.*, found {name!r}"
            )
    return feed


def _scale(amax: np.ndarray, margin: float) -> np.ndarray:
    return np.maximum(amax.astype(np.float64) * margin / _QMAX, _MIN_SCALE).astype(np.float32)


def scales_for_layer(
    amax: LayerAmax, *, latent: bool, mode: KVScaleMode, margin: float
) -> tuple[np.ndarray, np.ndarray | None]:
    """``(k_scale, v_scale)`` for one layer: ``[1]`` (per tensor) or ``(kv_heads, 1, head_size)`` (per channel).

    LATENT: one scale over the cached row ``[latent | k_pe]`` (the dense key then value), no ``v_scale``.
    """
    if latent:
        row = np.concatenate([amax.key, amax.value], axis=-1)  # [1, L + R]
        if mode == "per-tensor":
            return _scale(row.max(keepdims=True).reshape(1), margin), None
        return _scale(row[:, None, :], margin), None
    if mode == "per-tensor":
        return _scale(amax.key.max(keepdims=True).reshape(1), margin), _scale(
            amax.value.max(keepdims=True).reshape(1), margin
        )
    return _scale(amax.key[:, None, :], margin), _scale(amax.value[:, None, :], margin)


def _layer_of(cache: ir.Value | None) -> int:
    name = cache.name if cache is not None else None
    parts = (name or "").split(".")
    if len(parts) != 3 or parts[0] != "past_key_values" or not parts[1].isdigit():
        raise ConversionError(
            f"int8 KV: expected a PagedAttention key_cache named past_key_values.{{i}}.key, got {name!r}"
        )
    return int(parts[1])


def apply_scales(model: ir.Model, amax: dict[int, LayerAmax], *, mode: KVScaleMode, margin: float) -> None:
    """In place: int8 caches (graph inputs and the aliased present outputs), scale initializers, quant attrs."""
    graph = model.graph
    nodes = [n for n in graph if n.op_type == "PagedAttention" and n.domain == "com.microsoft"]
    if not nodes:
        raise ConversionError("int8 KV: the converted model has no PagedAttention node")
    int8 = ir.TensorType(ir.DataType.INT8)
    for node in nodes:
        layer = _layer_of(node.inputs[3])
        if layer not in amax:
            raise ConversionError(f"int8 KV: calibration produced no statistics for layer {layer}")
        layout = node.attributes.get("kv_cache_layout")
        latent = layout is not None and layout.value == "LATENT"
        k_scale, v_scale = scales_for_layer(amax[layer], latent=latent, mode=mode, margin=margin)
        caches = [(3, 1, "k", k_scale)] + ([] if latent else [(4, 2, "v", v_scale)])
        if len(node.inputs) < 16:
            node.resize_inputs(16)
        for cache_in, cache_out, kind, scale in caches:
            assert scale is not None
            node.inputs[cache_in].type = int8
            node.outputs[cache_out].type = int8
            name = f"kv_quant.layers.{layer}.{kind}_scale"
            value = ir.Value(name=name, shape=ir.Shape(scale.shape), type=ir.TensorType(ir.DataType.FLOAT))
            value.const_value = ir.tensor(scale, name=name)
            graph.register_initializer(value)
            node.replace_input_with(14 if kind == "k" else 15, value)
            node.attributes[f"{kind}_quant_type"] = ir.AttrString(f"{kind}_quant_type", _QUANT_TYPE[mode])
            node.attributes[f"{kind}_cache_dtype"] = ir.AttrString(f"{kind}_cache_dtype", "int8")
        while node.inputs and node.inputs[-1] is None:  # no attention_metadata: drop the padding again
            node.resize_inputs(len(node.inputs) - 1)
    model.metadata_props["ortpa.kv_cache_dtype"] = "int8"
    model.metadata_props["ortpa.kv_scale"] = f"{mode}, margin {margin:g}, static (calibrated)"
