"""Host-side run-time checks: ``attention_metadata``'s shape (§1.8.9) and ``ComputeInternal``'s §1.10 checks.

ONNX Runtime checks these when the kernel runs; the ones decidable on the host are here: do_rotary needs the
rotary caches (§1.10.1), non-empty input needs a cache block (§1.10.5), and attention_metadata's values,
which live in CPU memory, are checked when known (§1.10.9).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ortpa.ops.validate.checks import Rules, dim, fmt_shape

__all__ = ["check_compute", "check_metadata_values"]


def check_compute(
    inputs: Mapping[str, Any],
    has: dict,
    shp: dict,
    a: dict,
    token_count: int | None,
    num_blocks: int | None,
    max_blocks: int | None,
    block_size: int | None,
    r: Rules,
) -> None:
    """§1.8.9 then §1.10.1, §1.10.5 and §1.10.9, in the kernel's order."""
    if has["attention_metadata"]:
        md = shp["attention_metadata"]
        r.check(
            "1.8.9",
            "attention_metadata",
            {"shape of attention_metadata": md and dim(md, 0)},
            lambda: len(md) != 1 or md[0] not in (2, 3),
            lambda: f"Input 'attention_metadata' must have shape (2) or (3), got {fmt_shape(md)}",
        )

    # §1.10 ComputeInternal, the parts decidable on the host
    do_rotary = a["do_rotary"] == 1
    if do_rotary and not (has["cos_cache"] and has["sin_cache"]):
        r.fail("1.10.1", "cos_cache", "cos_cache and sin_cache must be passed to PagedAttention when do_rotary = 1")
    if token_count != 0:
        r.check(
            "1.10.5",
            "key_cache",
            {"token_count": token_count, "num_blocks": num_blocks},
            lambda: num_blocks <= 0,
            lambda: "PagedAttention requires at least one physical cache block for non-empty input.",
        )
        check_metadata_values(inputs.get("attention_metadata"), token_count, max_blocks, block_size, r)


def check_metadata_values(
    md: Any, token_count: int | None, max_blocks: int | None, block_size: int | None, r: Rules
) -> None:
    """§1.10.9: attention_metadata lives in CPU memory, so its values are checked on the host when known."""
    if not isinstance(md, np.ndarray) or md.ndim != 1 or md.shape[0] not in (2, 3):
        return  # a stand-in without values, or a shape 1.8.9 has already judged
    if md.dtype.kind not in "iu":
        return  # type.S has already judged the element type
    vals = [int(x) for x in md]
    q, kv, lo = vals[0], vals[1], vals[2] if len(vals) == 3 else 0
    if min(q, kv, lo) < 0:
        r.fail(
            "1.10.9.1",
            "attention_metadata",
            f"PagedAttention: 'attention_metadata' entries must be non-negative, got [{q}, {kv}, {lo}]. "
            "Use 0 for 'unknown'.",
        )
    cap = None if max_blocks is None or block_size is None else max_blocks * block_size
    bound = None if cap is None else kv if 0 < kv < cap else cap
    r.check(
        "1.10.9.2",
        "attention_metadata",
        {"block table capacity": bound},
        lambda: lo > bound,
        lambda: (
            f"PagedAttention: attention_metadata max_kv_len_lower_bound ({lo}) must not exceed "
            f"max_kv_len_bound ({bound})."
        ),
    )
