"""Quantized caches: ``CheckInputs`` §1.8.1–§1.8.8 (quant types, scales, cache dtypes) and §1.9.1 (uint8 = int4).

:func:`check_quantization` runs them in the kernel's order: the key cache's quantization, the value cache's
(SEPARATE only), then each cache dtype attribute against the cache tensor's storage type.
"""

from __future__ import annotations

import math

from ortpa.ops.validate.checks import Rules, fmt_shape

__all__ = ["check_cache_dtype", "check_quant", "check_quantization"]


def check_quantization(
    has: dict,
    shp: dict,
    a: dict,
    storage: str | None,
    kvh: int,
    head_size: int | None,
    v_head_size: int | None,
    latent: bool,
    r: Rules,
) -> None:
    """§1.8.1–§1.8.8 and §1.9.1 for both caches; ``storage`` is the key cache's storage type (None: unknown)."""
    quantized = None if storage is None else storage in ("int8", "float8e4m3fn", "int4", "float4e2m1")
    check_quant("k", has, shp, a, quantized, kvh, head_size, r)
    if not latent:
        check_quant("v", has, shp, a, quantized, kvh, v_head_size, r)
    for attr in ("k_cache_dtype",) if latent else ("k_cache_dtype", "v_cache_dtype"):
        check_cache_dtype(attr, a[attr], storage, r)


def check_quant(
    kind: str, has: dict, shp: dict, a: dict, quantized: bool | None, kvh: int, head_size: int | None, r: Rules
) -> None:
    """§1.8 CheckKVCacheQuantization for the key (``kind="k"``) or value cache."""
    qt_name, scale_name = f"{kind}_quant_type", f"{kind}_scale"
    qt = a[qt_name]
    if qt == "NONE":
        if has[scale_name]:
            r.fail("1.8.1", scale_name, f"Input '{scale_name}' must not be provided when '{qt_name}' is 'NONE'.")
        r.check(
            "1.8.2",
            qt_name,
            {"key_cache element type": quantized},
            lambda: quantized,
            lambda: f"The KV cache has a quantized element type, so '{qt_name}' must be 'PER_TENSOR' or 'PER_CHANNEL'.",
        )
        return
    r.check(
        "1.8.3",
        qt_name,
        {"key_cache element type": quantized},
        lambda: not quantized,
        lambda: (
            f"'{qt_name}' is set, but the KV cache element type is not quantized. Use an int8 or "
            f"float8e4m3fn cache, or set '{qt_name}' to 'NONE'."
        ),
    )
    if not has[scale_name]:
        r.fail("1.8.4", scale_name, f"Input '{scale_name}' is required when '{qt_name}' is not 'NONE'.")
    s = shp[scale_name]
    count = None if s is None or not all(isinstance(d, int) for d in s) else math.prod(s)
    if qt == "PER_TENSOR":
        r.check(
            "1.8.5",
            scale_name,
            {f"shape of {scale_name}": count},
            lambda: count != 1,
            lambda: f"Input '{scale_name}' must have exactly 1 element for PER_TENSOR quantization, got {count}",
        )
    else:
        r.check(
            "1.8.6",
            scale_name,
            {f"shape of {scale_name}": count, "head_size": head_size},
            lambda: count != kvh * head_size or len(s) == 0 or s[-1] != head_size,
            lambda: (
                f"Input '{scale_name}' must have shape (kv_num_heads, 1, head_size) = ({kvh}, 1, "
                f"{head_size}) for PER_CHANNEL quantization, got {fmt_shape(s)}"
            ),
        )


def check_cache_dtype(attr: str, value: str, storage: str | None, r: Rules) -> None:
    """§1.8 CheckKVCacheDataType with the §1.9 rule that a uint8 cache must name 'int4'."""
    if storage is None:
        if value:
            r.unchecked.append(("1.8.8", f"'{attr}' cannot be compared with an unknown cache element type"))
        return
    if storage == "int4" and value == "":
        r.fail(
            "1.9.1",
            attr,
            f"'{attr}' must be 'int4' for a uint8 (packed) cache, got ''. Packed uint8 caches require an "
            "explicit int4 logical type.",
        )
    if value in ("", storage):
        return
    if value in ("int4", "float4e2m1"):
        r.fail(
            "1.8.7", attr, f"'{attr}' == '{value}' requires a uint8 packed cache, which is not enabled in this build."
        )
    r.fail(
        "1.8.8",
        attr,
        f"'{attr}' is '{value}', but the cache tensor's element type is '{storage}'. Leave the attribute at '' "
        "to use the tensor's element type.",
    )
