"""The optional extras: ``CheckInputs`` §1.7 (head_sink, QK-norm weights, rotary caches, rotary_offset).

Each extra is checked only when given, in the kernel's order; the rotary caches yield ``rotary_dim``
(twice their dim 1, 0 without them, ``None`` when unknown).
"""

from __future__ import annotations

from ortpa.ops.validate.checks import Rules, dim

__all__ = ["check_extras"]


def check_extras(has: dict, shp: dict, a: dict, nh: int, head_size: int | None, r: Rules) -> int | None:
    """§1.7 head_sink, QK-norm weights, rotary caches and rotary_offset; returns rotary_dim (0 without rotary)."""
    if has["head_sink"]:
        hs = shp["head_sink"]
        r.has_rank("1.7.1", "head_sink", hs, 1, lambda n: "head_sink must be a 1D tensor")
        r.dim_is(
            "1.7.2",
            "head_sink",
            hs,
            0,
            nh,
            lambda got: f"head_sink dimension 0 must be equal to the num heads, got {got}",
        )
    if has["q_norm_weight"] != has["k_norm_weight"]:
        r.fail(
            "1.7.3",
            "k_norm_weight" if has["q_norm_weight"] else "q_norm_weight",
            "Input 'q_norm_weight' and 'k_norm_weight' must be provided together.",
        )
    if has["q_norm_weight"]:
        for rule, name in (("1.7.4", "q_norm_weight"), ("1.7.5", "k_norm_weight")):
            w = shp[name]
            message = f"Input '{name}' must be a 1D tensor of shape (head_size) = ({head_size})."
            if w is not None and len(w) != 1:
                r.fail(rule, name, message)
            r.check(
                rule,
                name,
                {"head_size": head_size, f"{name} dim 0": dim(w, 0)},
                lambda w=w: w[0] != head_size,
                lambda message=message: message,
            )
        eps = a["qk_norm_epsilon"]
        if not eps > 0.0:
            r.fail("1.7.6", "qk_norm_epsilon", f"qk_norm_epsilon must be positive, got {eps:g}")
    rotary_dim: int | None = 0
    if has["cos_cache"] and has["sin_cache"]:
        r.check(
            "1.7.7",
            "cos_cache",
            {"head_size": head_size},
            lambda: head_size % 16 != 0,
            lambda: f"head_size shall be a multiple of 16. Got head_size % 16 == {head_size % 16}",
        )
        dims = {}
        for name in ("cos_cache", "sin_cache"):
            c = shp[name]
            r.has_rank(
                "1.7.rank",
                name,
                c,
                2,
                lambda n, name=name: (
                    f"Input '{name}' is expected to have 2 dimensions, got {n} "
                    "(ONNX Runtime does not check this and reads dims 0 and 1 regardless)"
                ),
            )
            dims[name] = dim(c, 1)
        for rule, name in (("1.7.8", "cos_cache"), ("1.7.9", "sin_cache")):
            d = dims[name]
            r.check(
                rule,
                name,
                {"head_size": head_size, f"{name} dim 1": d},
                lambda d=d: d > (head_size // 16) * 8 or d % 8 != 0,
                lambda name=name: f"{name} dimension 1 must be <= head_size / 2 and a multiple of 8.",
            )
        cos1, sin1 = dims["cos_cache"], dims["sin_cache"]
        r.check(
            "1.7.10",
            "sin_cache",
            {"cos_cache dim 1": cos1, "sin_cache dim 1": sin1},
            lambda: cos1 != sin1,
            lambda: "cos_cache and sin_cache dimension 1 must be the same.",
        )
        rotary_dim = None if cos1 is None else 2 * cos1
    elif has["cos_cache"] or has["sin_cache"]:
        r.fail(
            "1.7.11",
            "sin_cache" if has["cos_cache"] else "cos_cache",
            "Input 'cos_cache' and 'sin_cache' shall be both present or both absent.",
        )
    ro = a["rotary_offset"]
    if ro < 0 or ro % 8 != 0:
        r.fail("1.7.12", "rotary_offset", f"'rotary_offset' must be non-negative and a multiple of 8, got {ro}")
    r.check(
        "1.7.13",
        "rotary_offset",
        {"rotary_dim": rotary_dim, "head_size": head_size},
        lambda: ro + rotary_dim > head_size,
        lambda: f"'rotary_offset' + rotary_dim must not exceed head_size. Got {ro} + {rotary_dim} > {head_size}",
    )
    return rotary_dim
