"""What each PagedAttention backend implements, as data, and the gate that enforces it.

A node that passes :func:`ortpa.ops.validate.check_inputs` is valid for the op; whether a given backend can
run it is a separate question. ``cuda`` is ONNX Runtime's CUDA kernel (reference §3.3), ``webgpu`` its WebGPU
kernel (§4), ``portable`` ortpa's own implementation in standard ONNX ops (``ortpa.ops.portable``), which
the runtime uses on every other execution provider.

Each backend is a :class:`BackendSupport`: the set of :data:`FEATURES` it implements, plus notes (supported
with a caveat, e.g. a build flag) and details (the backend's own rejection text). To change what a backend
does, edit its entry in :data:`BACKENDS` — nothing else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ortpa.errors import NotImplementedByBackend
from ortpa.ops.params import PagedAttentionParams
from ortpa.providers import CUDA, WEBGPU

__all__ = [
    "BACKENDS",
    "FEATURES",
    "BackendSupport",
    "available_backends",
    "backend_for_provider",
    "check_backend",
    "features_used",
]


def _info(info: Mapping[str, Any] | None, key: str, default: Any = None) -> Any:
    return default if info is None else info.get(key, default)


def _cache_outputs(info: Mapping[str, Any] | None) -> tuple[bool, bool] | None:
    outs = _info(info, "cache_outputs")
    return None if outs is None else (bool(outs[0]), bool(outs[1]))


def _activation(p: PagedAttentionParams, info: Mapping[str, Any] | None) -> str | None:
    return _info(info, "activation_dtype") or p.activation_dtype


_Pred = Callable[[PagedAttentionParams, "Mapping[str, Any] | None"], bool]

# Every feature a node can use, in the order the gate reports them: id -> "is it used by this node?".
# ``info`` carries what the params do not: "activation_dtype" and "cache_outputs" (key_out?, value_out?).
FEATURES: Mapping[str, _Pred] = MappingProxyType(
    {
        "float16 activations": lambda p, i: _activation(p, i) == "float16",
        "bfloat16 activations": lambda p, i: _activation(p, i) == "bfloat16",
        "float16 KV cache": lambda p, i: p.cache_storage_dtype == "float16",
        "bfloat16 KV cache": lambda p, i: p.cache_storage_dtype == "bfloat16",
        "KV cache of another float type than the activations": lambda p, i: (
            p.cache_storage_dtype in ("float16", "bfloat16")
            and _activation(p, i) is not None
            and p.cache_storage_dtype != _activation(p, i)
        ),
        "int8 KV cache": lambda p, i: p.cache_storage_dtype == "int8",
        "float8e4m3fn KV cache": lambda p, i: p.cache_storage_dtype == "float8e4m3fn",
        "int4 (packed uint8) KV cache": lambda p, i: p.cache_storage_dtype == "int4",
        "float4e2m1 KV cache": lambda p, i: "float4e2m1" in (p.k_cache_dtype, p.v_cache_dtype),
        "PER_TENSOR quantization": lambda p, i: "PER_TENSOR" in (p.k_quant_type, p.v_quant_type),
        "PER_CHANNEL quantization": lambda p, i: "PER_CHANNEL" in (p.k_quant_type, p.v_quant_type),
        "k_scale/v_scale inputs": lambda p, i: p.k_quant_type != "NONE" or p.v_quant_type != "NONE",
        "kv_cache_layout=LATENT": lambda p, i: p.is_latent,
        "kv_cache_layout=LATENT with an int4 cache": lambda p, i: p.is_latent and p.cache_storage_dtype == "int4",
        "v_head_size != head_size": lambda p, i: p.v_head_size is not None and p.v_head_size != p.head_size,
        "packed QKV": lambda p, i: p.is_packed_qkv,
        "grouped-query attention": lambda p, i: p.kv_num_heads < p.num_heads and not p.is_latent,
        "rotary embedding": lambda p, i: p.do_rotary,
        "interleaved rotary embedding": lambda p, i: p.do_rotary and p.rotary_interleaved,
        "rotary_offset != 0": lambda p, i: p.rotary_offset != 0,
        "softcap": lambda p, i: p.softcap != 0.0,
        "local window": lambda p, i: p.local_window_size > 0,
        "is_causal=0": lambda p, i: not p.is_causal,
        "head_sink": lambda p, i: p.has_head_sink,
        "QK RMSNorm": lambda p, i: p.use_qk_norm,
        "slot_mapping": lambda p, i: p.has_slot_mapping,
        "attention_metadata": lambda p, i: p.has_attention_metadata,
        "exactly one cache output": lambda p, i: (
            not p.is_latent and _cache_outputs(i) is not None and sum(_cache_outputs(i)) == 1
        ),
    }
)

_ALL = frozenset(FEATURES)


@dataclass(frozen=True)
class BackendSupport:
    """One backend: the features it implements, caveats on some of them, its own rejection texts."""

    name: str
    supported: frozenset[str]
    notes: Mapping[str, str] = field(default_factory=dict)
    details: Mapping[str, str] = field(default_factory=dict)
    max_threads_per_block: int = 0  # what the backend passes to CheckInputs (rule 1.1.1); 0 = no limit

    def __post_init__(self) -> None:
        unknown = (self.supported | set(self.notes) | set(self.details)) - _ALL
        if unknown:
            raise ValueError(f"backend {self.name!r} names unknown features {sorted(unknown)}; known: {sorted(_ALL)}")


_WEBGPU = "PagedAttention (WebGPU): "

BACKENDS: Mapping[str, BackendSupport] = MappingProxyType(
    {
        # reference §3.3 (CUDA, 1.32-era)
        "cuda": BackendSupport(
            name="cuda",
            supported=_ALL
            - {
                "KV cache of another float type than the activations",
                "float4e2m1 KV cache",
                "kv_cache_layout=LATENT with an int4 cache",
            },
            notes={
                "int4 (packed uint8) KV cache": "needs an ONNX Runtime build with USE_INT4_KV_CACHE (off by default)",
                "float8e4m3fn KV cache": "needs an ONNX Runtime build with USE_FP8_KV_CACHE",
            },
            details={
                "KV cache of another float type than the activations": "CUDA registers (T, T_CACHE) = (fp16, fp16), "
                "(bf16, bf16) and quantized caches only; there is no fp16/bf16 mix",
                "float4e2m1 KV cache": "rejected by the CUDA kernel",
                "kv_cache_layout=LATENT with an int4 cache": "the latent kernel reads cache bytes as values and does "
                "not decode packed int4 nibbles",
            },
            max_threads_per_block=1024,
        ),
        # reference §4 (WebGPU, PR #31611)
        "webgpu": BackendSupport(
            name="webgpu",
            supported=frozenset(
                {
                    "float16 activations",
                    "float16 KV cache",
                    "packed QKV",
                    "grouped-query attention",
                    "rotary embedding",
                    "interleaved rotary embedding",
                    "local window",
                    "is_causal=0",
                    "head_sink",
                    "QK RMSNorm",
                    "attention_metadata",
                }
            ),
            details={
                "bfloat16 activations": "the WebGPU kernel is registered for float16 only",
                "bfloat16 KV cache": _WEBGPU + "only float16 KV cache dtype is supported.",
                "int8 KV cache": _WEBGPU + "only float16 KV cache dtype is supported.",
                "float8e4m3fn KV cache": _WEBGPU + "only float16 KV cache dtype is supported.",
                "int4 (packed uint8) KV cache": _WEBGPU + "only float16 KV cache dtype is supported.",
                "PER_TENSOR quantization": _WEBGPU + "quantized KV cache is not supported yet.",
                "PER_CHANNEL quantization": _WEBGPU + "quantized KV cache is not supported yet.",
                "k_scale/v_scale inputs": _WEBGPU + "k_scale/v_scale inputs are not supported yet.",
                "softcap": _WEBGPU + "non-zero softcap is not supported yet.",
                "kv_cache_layout=LATENT": _WEBGPU + "kv_cache_layout='LATENT' is not supported yet.",
                "v_head_size != head_size": _WEBGPU + "v_head_size != head_size is not supported yet.",
                "rotary_offset != 0": _WEBGPU + "rotary_offset != 0 is not supported yet.",
                "slot_mapping": _WEBGPU + "slot_mapping input is not supported yet.",
                "exactly one cache output": _WEBGPU
                + "key_cache_out and value_cache_out must be both present or both absent.",
            },
        ),
        # ortpa.ops.native: ortpa's own CPU kernel (C++ custom op), the CPU provider's default where it is built.
        # Every feature of the op (and float32 activations besides); tests/ops/native runs each against the oracle.
        "native-cpu": BackendSupport(
            name="native-cpu",
            supported=_ALL - {"float4e2m1 KV cache", "kv_cache_layout=LATENT with an int4 cache"},
            details={
                "float4e2m1 KV cache": "the op has no float4 cache (rule 1.8.7 rejects it); no kernel implements it",
                "kv_cache_layout=LATENT with an int4 cache": "undefined in the op (the CUDA latent kernel reads the "
                "packed bytes as values), so the native kernel refuses it, as the oracle does",
            },
        ),
        # ortpa.ops.portable: what its graph implements (ortpa.ops.portable.PORTABLE_FEATURES is this set)
        "portable": BackendSupport(
            name="portable",
            supported=frozenset(
                {
                    "float16 activations",
                    "bfloat16 activations",
                    "float16 KV cache",
                    "bfloat16 KV cache",
                    "int8 KV cache",
                    "PER_TENSOR quantization",
                    "PER_CHANNEL quantization",
                    "k_scale/v_scale inputs",
                    "kv_cache_layout=LATENT",
                    "v_head_size != head_size",
                    "packed QKV",
                    "grouped-query attention",
                    "rotary embedding",
                    "interleaved rotary embedding",
                    "rotary_offset != 0",
                    "softcap",
                    "local window",
                    "is_causal=0",
                    "head_sink",
                    "QK RMSNorm",
                    "slot_mapping",
                    "attention_metadata",  # accepted and ignored: the bounds never change results
                    "exactly one cache output",
                }
            ),
            details={
                "float8e4m3fn KV cache": "ONNX Gather/ScatterND accept no float8 type, so ortpa.ops.portable can "
                "neither write nor read a float8 cache block-wise",
                "int4 (packed uint8) KV cache": "ortpa.ops.portable does not unpack int4 caches",
                "kv_cache_layout=LATENT with an int4 cache": "ortpa.ops.portable does not unpack int4 caches",
                "KV cache of another float type than the activations": "ortpa.ops.portable expects the cache in "
                "the activation type unless it is quantized",
            },
        ),
    }
)


def available_backends() -> tuple[str, ...]:
    """Names accepted by :func:`check_backend` (and ``ortpa validate --backend``)."""
    return tuple(BACKENDS)


_PROVIDERS = {CUDA: "cuda", WEBGPU: "webgpu"}


def backend_for_provider(provider_name: str) -> str | None:
    """The native backend of an execution provider; None means the provider has none (use ``portable``)."""
    return _PROVIDERS.get(provider_name)


def features_used(params: PagedAttentionParams, info: Mapping[str, Any] | None = None) -> tuple[str, ...]:
    """Every feature of :data:`FEATURES` this node uses, in gate order."""
    return tuple(name for name, used in FEATURES.items() if used(params, info))


def check_backend(
    params: PagedAttentionParams,
    attrs_or_node_info: Mapping[str, Any] | None,
    backend: str,
    *,
    node: str | None = None,
) -> tuple[str, ...]:
    """Raise :class:`NotImplementedByBackend` for the first feature ``backend`` does not implement.

    ``attrs_or_node_info`` may be the node's attributes or any mapping; the keys read are
    ``activation_dtype`` (else ``params.activation_dtype``) and ``cache_outputs`` (a pair of booleans:
    key_cache_out / value_cache_out present). Returns the notes (caveats) of the features used.
    """
    support = BACKENDS.get(backend)
    if support is None:
        raise ValueError(f"unknown backend {backend!r}; expected one of {available_backends()}")
    notes = []
    for feature in features_used(params, attrs_or_node_info):
        if feature not in support.supported:
            detail = support.details.get(feature, f"the {backend} backend has no implementation of it")
            raise NotImplementedByBackend(backend, feature, detail, node=node)
        if feature in support.notes:
            notes.append(f"{feature}: {support.notes[feature]}")
    return tuple(notes)
