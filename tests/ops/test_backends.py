"""ortpa.ops.backends: every feature a backend lacks is refused by name; supported modes pass."""

from __future__ import annotations

from dataclasses import replace

import ml_dtypes
import numpy as np
import pytest
from validate_cases import ACCEPT, build

from ortpa.errors import NotImplementedByBackend
from ortpa.ops.backends import (
    BACKENDS,
    FEATURES,
    BackendSupport,
    available_backends,
    backend_for_provider,
    check_backend,
    features_used,
)
from ortpa.ops.validate import check_inputs


def _params(case_id: str = "separate", t_dtype=np.float16):
    inputs, attrs = build(next(c for c in ACCEPT if c.id == case_id), t_dtype)
    return check_inputs(inputs, attrs)


BASE = _params()
# feature -> (changes to the fp16 SEPARATE baseline, node info); params are edited directly so the gate is
# tested on its own, including combinations the validator would refuse first.
MODS: dict[str, tuple[dict, dict]] = {
    "bfloat16 activations": ({"activation_dtype": "bfloat16", "cache_storage_dtype": "bfloat16"}, {}),
    "bfloat16 KV cache": ({"cache_storage_dtype": "bfloat16"}, {}),
    "KV cache of another float type than the activations": ({"cache_storage_dtype": "bfloat16"}, {}),
    "int8 KV cache": ({"cache_storage_dtype": "int8", "k_quant_type": "PER_TENSOR"}, {}),
    "float8e4m3fn KV cache": ({"cache_storage_dtype": "float8e4m3fn", "k_quant_type": "PER_TENSOR"}, {}),
    "int4 (packed uint8) KV cache": ({"cache_storage_dtype": "int4", "k_cache_dtype": "int4"}, {}),
    "float4e2m1 KV cache": ({"k_cache_dtype": "float4e2m1"}, {}),
    "PER_TENSOR quantization": ({"k_quant_type": "PER_TENSOR"}, {}),
    "PER_CHANNEL quantization": ({"v_quant_type": "PER_CHANNEL"}, {}),
    "kv_cache_layout=LATENT": ({"layout": "LATENT", "kv_num_heads": 1}, {}),
    "kv_cache_layout=LATENT with an int4 cache": ({"layout": "LATENT", "cache_storage_dtype": "int4"}, {}),
    "v_head_size != head_size": ({"v_head_size": 8}, {}),
    "packed QKV": ({"is_packed_qkv": True}, {}),
    "rotary embedding": ({"do_rotary": True}, {}),
    "interleaved rotary embedding": ({"do_rotary": True, "rotary_interleaved": True}, {}),
    "rotary_offset != 0": ({"rotary_offset": 8}, {}),
    "softcap": ({"softcap": 50.0}, {}),
    "local window": ({"local_window_size": 128}, {}),
    "is_causal=0": ({"is_causal": False}, {}),
    "head_sink": ({"has_head_sink": True}, {}),
    "QK RMSNorm": ({"use_qk_norm": True}, {}),
    "slot_mapping": ({"has_slot_mapping": True}, {}),
    "attention_metadata": ({"has_attention_metadata": True}, {}),
    "exactly one cache output": ({}, {"cache_outputs": (True, False)}),
}
# features only reachable together with an earlier refused one (the gate names the earlier one)
SHADOWED = {
    ("webgpu", "k_scale/v_scale inputs"): "PER_TENSOR quantization",
    ("portable", "kv_cache_layout=LATENT with an int4 cache"): "int4 (packed uint8) KV cache",
    ("webgpu", "kv_cache_layout=LATENT with an int4 cache"): "kv_cache_layout=LATENT",
    ("webgpu", "KV cache of another float type than the activations"): "bfloat16 KV cache",
}


def test_every_feature_has_a_mod() -> None:
    assert set(FEATURES) - set(MODS) <= {"float16 activations", "float16 KV cache", "grouped-query attention",
                                         "k_scale/v_scale inputs"}  # fmt: skip


# ids avoid the bare word "cuda": conftest skips tests carrying a `cuda` keyword on machines without CUDA
@pytest.mark.parametrize("backend", available_backends(), ids=lambda b: f"backend={b}")
def test_each_refused_feature_is_named(backend: str) -> None:
    support = BACKENDS[backend]
    refused = set(FEATURES) - support.supported
    named = set()
    for feature in sorted(refused):
        if (backend, feature) in SHADOWED:
            continue
        changes, info = MODS[feature]
        with pytest.raises(NotImplementedByBackend) as exc:
            check_backend(replace(BASE, **changes), info, backend, node="n")
        assert (exc.value.backend, exc.value.node) == (backend, "n")
        assert exc.value.feature == feature, f"{backend}: expected {feature!r}, got {exc.value.feature!r}"
        assert backend in str(exc.value) and feature in str(exc.value) and exc.value.detail
        named.add(feature)
    assert named | {f for b, f in SHADOWED if b == backend} >= refused


# ids avoid the bare word "cuda": conftest skips tests carrying a `cuda` keyword on machines without CUDA
@pytest.mark.parametrize("backend", available_backends(), ids=lambda b: f"backend={b}")
def test_supported_features_pass(backend: str) -> None:
    for feature in BACKENDS[backend].supported:
        changes, info = MODS.get(feature, ({}, {}))
        used = features_used(replace(BASE, **changes), info)
        if set(used) <= BACKENDS[backend].supported:
            check_backend(replace(BASE, **changes), info, backend)


def test_brief_matrix() -> None:
    lat = _params("latent")
    assert check_backend(lat, None, "cuda") == () and check_backend(lat, None, "portable") == ()
    i4 = _params("int4")
    notes = check_backend(i4, None, "cuda")
    assert any("USE_INT4_KV_CACHE" in n for n in notes)
    with pytest.raises(NotImplementedByBackend, match="int4"):
        check_backend(i4, None, "portable")
    for case in ("int8-per-tensor", "int8-per-channel", "all-extras", "rope-partial-offset", "packed"):
        check_backend(_params(case), {"cache_outputs": (True, True)}, "portable")
    check_backend(_params("fp8"), {"cache_outputs": (True, True)}, "cuda")
    with pytest.raises(NotImplementedByBackend, match="float8"):  # ONNX Gather/ScatterND have no float8 form
        check_backend(_params("fp8"), {"cache_outputs": (True, True)}, "portable")
    bf = _params("separate", ml_dtypes.bfloat16)
    check_backend(bf, None, "cuda")
    with pytest.raises(NotImplementedByBackend) as exc:
        check_backend(bf, None, "webgpu")
    assert exc.value.feature == "bfloat16 activations"
    webgpu_ok = _params("all-extras")
    with pytest.raises(NotImplementedByBackend, match="softcap"):
        check_backend(webgpu_ok, None, "webgpu")
    check_backend(replace(webgpu_ok, softcap=0.0, has_slot_mapping=False), {"cache_outputs": (True, True)}, "webgpu")


def test_providers_and_errors() -> None:
    assert backend_for_provider("CUDAExecutionProvider") == "cuda"
    assert backend_for_provider("WebGpuExecutionProvider") == "webgpu"
    assert backend_for_provider("CPUExecutionProvider") is None
    assert backend_for_provider("DmlExecutionProvider") is None
    assert set(available_backends()) == {"cuda", "webgpu", "portable", "native-cpu"}
    with pytest.raises(ValueError, match="unknown backend"):
        check_backend(BASE, None, "tpu")
    with pytest.raises(ValueError, match="unknown features"):
        BackendSupport("x", frozenset({"teleportation"}))
