"""Head counts and sizes: ``CheckInputs`` §1.1 (head counts), §1.2 (Q/K/V mode) and §1.3 (v_head_size, scale).

§1.2 reads the query/key/value shapes in one of three modes (LATENT, SEPARATE with key and value, packed
QKV) and derives the head size and hidden sizes as :class:`QKV`; the layout is inspected before the presence
of key, as the kernel does. Values a rule cannot derive (an unknown dimension) stay ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ortpa.ops.validate.checks import Rules, dim, raw

__all__ = ["QKV", "check_head_counts", "check_qkv", "check_v_head_size"]


@dataclass(frozen=True)
class QKV:
    """What §1.2 derives from the query/key/value shapes; ``None`` where a dimension is not known."""

    tokens: int | str | None  # query dim 0 as declared: an int, a symbolic name or None
    head_size: int | None
    hidden_size: int | None
    kv_hidden_size: int | None
    is_packed: bool

    @property
    def token_count(self) -> int | None:
        return self.tokens if isinstance(self.tokens, int) else None


def check_head_counts(nh: int, kvh: int, max_threads_per_block: int, r: Rules) -> None:
    """§1.1: num_heads fits a thread block (0 skips the limit) and is a multiple of kv_num_heads."""
    if max_threads_per_block > 0 and nh > max_threads_per_block:
        r.fail("1.1.1", "num_heads", f"num_heads should be no larger than {max_threads_per_block}")
    if nh % kvh != 0:
        r.fail(
            "1.1.2",
            "num_heads",
            f"num_heads must be a multiple of kv_num_heads. Got num_heads % kv_num_heads == {nh % kvh}",
        )


def check_qkv(has: dict, shp: dict, nh: int, kvh: int, latent: bool, r: Rules) -> QKV:
    """§1.2 in the kernel's order for the mode the layout and the presence of key select."""
    q = shp["query"]
    tok = raw(q, 0)
    if latent:
        head_size, q_hidden, kv_hidden = _latent(has, shp, tok, nh, kvh, r)
    elif has["key"]:
        head_size, q_hidden, kv_hidden = _separate(has, shp, tok, nh, kvh, r)
    else:
        head_size, q_hidden, kv_hidden = _packed(has, q, nh, kvh, r)
    return QKV(tok, head_size, q_hidden, kv_hidden, is_packed=not latent and not has["key"])


def _latent(has: dict, shp: dict, tok: Any, nh: int, kvh: int, r: Rules) -> tuple[int | None, ...]:
    if not has["key"]:
        r.fail("1.2.latent.1", "key", "Input 'key' is required when 'kv_cache_layout' is 'LATENT'.")
    if has["value"]:
        r.fail(
            "1.2.latent.2",
            "value",
            "Input 'value' must be absent when 'kv_cache_layout' is 'LATENT': the value of every head is "
            "the leading 'v_head_size' channels of the latent key.",
        )
    q, k = shp["query"], shp["key"]
    r.has_rank("1.2.latent.3", "query", q, 2)
    q_hidden = dim(q, 1)
    head_size = None
    if r.check(
        "1.2.latent.4",
        "query",
        {"query dim 1": q_hidden},
        lambda: q_hidden % nh != 0,
        lambda: f"Input 'query' hidden size must be a multiple of num_heads. Got {q_hidden} % {nh} == {q_hidden % nh}",
    ):
        head_size = q_hidden // nh
    _head_size_multiple_of_8("1.2.latent.5", head_size, r)
    kv_hidden = _token_rows("1.2.latent.6", "1.2.latent.7", "key", k, tok, r)
    r.check(
        "1.2.latent.8",
        "key",
        {"head_size": head_size, "key dim 1": kv_hidden},
        lambda: kv_hidden != kvh * head_size,
        lambda: (
            "Input 'key' is expected to have hidden size kv_num_heads * head_size = "
            f"{kvh * head_size} in 'LATENT' mode, got {kv_hidden}"
        ),
    )
    return head_size, q_hidden, kv_hidden


def _separate(has: dict, shp: dict, tok: Any, nh: int, kvh: int, r: Rules) -> tuple[int | None, ...]:
    q, k, v = shp["query"], shp["key"], shp["value"]
    r.has_rank("1.2.separate.1", "query", q, 2)
    q_hidden = dim(q, 1)
    head_size = None if q_hidden is None else q_hidden // nh  # divisibility is not checked (ORT quirk)
    _head_size_multiple_of_8("1.2.separate.2", head_size, r)
    if not has["value"]:
        r.fail(
            "1.2.separate.3",
            "value",
            "Input 'key' and 'value' shall be both present, or both absent in the case of packed qkv.",
        )
    kv_hidden = _token_rows("1.2.separate.4a", "1.2.separate.4b", "key", k, tok, r)
    r.check(
        "1.2.separate.5a",
        "key",
        {"key dim 1": kv_hidden},
        lambda: kv_hidden % kvh != 0,
        lambda: (
            f"kv_hidden_size must be a multiple of kv_num_heads. Got kv_hidden_size % kv_num_heads == {kv_hidden % kvh}"
        ),
    )
    r.check(
        "1.2.separate.5b",
        "key",
        {"key dim 1": kv_hidden, "head_size": head_size},
        lambda: kv_hidden // kvh != head_size,
        lambda: (
            f"kv_hidden_size / kv_num_heads must be equal to head_size. Got kv_hidden_size / kv_num_heads == "
            f"{kv_hidden // kvh}"
        ),
    )
    _token_rows("1.2.separate.6a", "1.2.separate.6b", "value", v, tok, r)
    r.same(
        "1.2.separate.6c",
        "value",
        ("key dim 1", raw(k, 1)),
        ("value dim 1", raw(v, 1)),
        lambda: "Input 'value' is expected to have same hidden size as key.",
    )
    return head_size, q_hidden, kv_hidden


def _packed(has: dict, q: tuple | None, nh: int, kvh: int, r: Rules) -> tuple[int | None, ...]:
    r.has_rank("1.2.packed.1", "query", q, 2)
    q_hidden = dim(q, 1)
    head_size = None if q_hidden is None else q_hidden // (nh + 2 * kvh)  # remainder unchecked (ORT)
    _head_size_multiple_of_8("1.2.packed.2", head_size, r)
    if has["value"]:
        r.fail(
            "1.2.packed.3",
            "value",
            "Input 'key' and 'value' shall be both present, or both absent in the case of packed qkv.",
        )
    if head_size is None:
        return None, q_hidden, None
    return head_size, head_size * nh, head_size * kvh


def _head_size_multiple_of_8(rule: str, head_size: int | None, r: Rules) -> None:
    r.check(
        rule,
        "query",
        {"head_size": head_size},
        lambda: head_size % 8 != 0,
        lambda: f"head_size must be a multiple of 8. Got head_size % 8 == {head_size % 8}",
    )


def _token_rows(rank_rule: str, tokens_rule: str, name: str, shape: tuple | None, tok: Any, r: Rules) -> int | None:
    """Key or value: 2-D, with the query's token count as dim 0; returns its dim 1 (hidden size) when known."""
    r.has_rank(rank_rule, name, shape, 2)
    r.same(
        tokens_rule,
        name,
        ("query dim 0", tok),
        (f"{name} dim 0", raw(shape, 0)),
        lambda: f"Input 'query' and '{name}' shall have same dim 0 (token count)",
    )
    return dim(shape, 1)


def check_v_head_size(a: dict, head_size: int | None, latent: bool, r: Rules) -> tuple[int | None, bool]:
    """§1.3: v_head_size is 0 or in [1, head_size], differs only in LATENT, and then needs an explicit scale.

    Returns ``(v_head_size, has_explicit_scale)``; an explicit 0.0 scale counts as unset (CUDA).
    """
    v_attr = a["v_head_size"]
    explicit_scale = a["scale"] != 0.0
    v_head_size = head_size
    if v_attr != 0:
        r.check(
            "1.3.1",
            "v_head_size",
            {"head_size": head_size},
            lambda: v_attr < 1 or v_attr > head_size,
            lambda: (
                f"'v_head_size' must be 0 (meaning head_size) or in [1, head_size] = [1, {head_size}], got {v_attr}"
            ),
        )
        r.check(
            "1.3.2",
            "v_head_size",
            {"head_size": head_size},
            lambda: v_attr != head_size and not latent,
            lambda: (
                f"'v_head_size' ({v_attr}) may only differ from head_size ({head_size}) when "
                "'kv_cache_layout' is 'LATENT'."
            ),
        )
        v_head_size = v_attr
    r.check(
        "1.3.3",
        "scale",
        {"head_size": head_size, "v_head_size": v_head_size},
        lambda: v_head_size != head_size and not explicit_scale,
        lambda: (
            f"An explicit 'scale' attribute is required when 'v_head_size' ({v_head_size}) differs from "
            f"head_size ({head_size}): the default 1/sqrt(head_size) is not the intended scale for absorbed MLA."
        ),
    )
    return v_head_size, explicit_scale
