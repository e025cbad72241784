"""The paged KV cache: ``CheckInputs`` §1.4 (layout constraints), §1.5 (``CheckKVCache``) and §1.6 (sequences).

§1.4 is what the LATENT and SEPARATE layouts forbid or require; §1.5 the cache tensors' shapes (a packed int4
cache stores ``(head_size + 1) // 2`` bytes per row, §1.9); §1.6 the sequence tensors, block table and slot
mapping that address the cache.
"""

from __future__ import annotations

from ortpa.ops.validate.checks import Rules, dim, raw

__all__ = ["check_kv_cache", "check_layout", "check_sequences"]


def check_layout(has: dict, a: dict, kvh: int, latent: bool, r: Rules) -> None:
    """§1.4: LATENT has one cache, one KV head, no head sink, no norm weights and no value quantization."""
    if latent:
        if has["value_cache"]:
            r.fail(
                "1.4.latent.1",
                "value_cache",
                "Input 'value_cache' must be absent when 'kv_cache_layout' is 'LATENT': the value cache is the "
                "leading 'v_head_size' channels of 'key_cache'.",
            )
        if kvh != 1:
            r.fail(
                "1.4.latent.2",
                "kv_num_heads",
                f"'kv_num_heads' must be 1 when 'kv_cache_layout' is 'LATENT', got {kvh}",
            )
        if has["head_sink"]:
            r.fail(
                "1.4.latent.3", "head_sink", "Input 'head_sink' is not supported when 'kv_cache_layout' is 'LATENT'."
            )
        if has["q_norm_weight"] or has["k_norm_weight"]:
            r.fail(
                "1.4.latent.4",
                "q_norm_weight" if has["q_norm_weight"] else "k_norm_weight",
                "Inputs 'q_norm_weight' / 'k_norm_weight' are not supported when 'kv_cache_layout' is 'LATENT': "
                "DeepSeek normalizes the latent projections in the graph, before absorption.",
            )
        if has["v_scale"] or a["v_quant_type"] != "NONE" or a["v_cache_dtype"] != "":
            r.fail(
                "1.4.latent.5",
                "v_scale" if has["v_scale"] else "v_quant_type" if a["v_quant_type"] != "NONE" else "v_cache_dtype",
                "Input 'v_scale' and attributes 'v_quant_type' / 'v_cache_dtype' must be unset when "
                "'kv_cache_layout' is 'LATENT': the value elements are the key elements, so 'k_scale' and "
                "'k_cache_dtype' describe both.",
            )
    elif not has["value_cache"]:
        r.fail("1.4.separate.1", "value_cache", "Input 'value_cache' is required unless 'kv_cache_layout' is 'LATENT'.")


def check_kv_cache(
    shp: dict, has_value_cache: bool, kvh: int, head_size: int | None, storage: str | None, r: Rules
) -> tuple[int | None, int | None]:
    """§1.5 CheckKVCache; the expected last dim is (head_size + 1) // 2 for a packed int4 cache (§1.9).

    Returns ``(num_blocks, block_size)`` from key_cache, ``None`` where unknown.
    """
    kc = shp["key_cache"]
    r.has_rank("1.5.1", "key_cache", kc, 4)
    nb, bs = dim(kc, 0), dim(kc, 1)
    r.check(
        "1.5.2",
        "key_cache",
        {"block_size (key_cache dim 1)": bs},
        lambda: bs < 16 or (bs & (bs - 1)) != 0,
        lambda: f"block_size must be a power of two and at least 16. Got block_size == {bs}",
    )
    r.dim_is("1.5.3", "key_cache", kc, 2, kvh, lambda got: f"Input 'key_cache' shall have kv_num_heads, got {got}")
    int4 = storage == "int4"
    expected = None if head_size is None else (head_size + 1) // 2 if int4 else head_size

    def last_dim_rule(which: str, got: int | None) -> None:
        deps = {"head_size": head_size, "key_cache element type": storage, f"{which} dim 3": got}
        if int4:
            rule = "1.9.2" if which == "key_cache" else "1.9.3"
            text = f"Input '{which}' dimension 3 should be (head_size + 1) / 2 = {expected} for a packed int4 cache"
        else:
            rule = "1.5.4" if which == "key_cache" else "1.5.11"
            text = f"Input '{which}' dimension 3 should be same as head_size"
        r.check(rule, which, deps, lambda: got != expected, lambda: f"{text}, got {got}")

    last_dim_rule("key_cache", dim(kc, 3))
    if not has_value_cache:
        return nb, bs  # LATENT: the single cache
    vc = shp["value_cache"]
    r.has_rank("1.5.6", "value_cache", vc, 4)
    for rule, i, what in (("1.5.7a", 0, "num_blocks"), ("1.5.7b", 1, "block_size")):
        r.same(
            rule,
            "value_cache",
            (f"key_cache dim {i} ({what})", raw(kc, i)),
            (f"value_cache dim {i}", raw(vc, i)),
            lambda i=i, what=what: f"Input 'value_cache' dimension {i} should be {what}, got {vc[i]}",
        )
    r.same(
        "1.5.8",
        "value_cache",
        ("key_cache dim 2", raw(kc, 2)),
        ("value_cache dim 2", raw(vc, 2)),
        lambda: (
            "Input 'key_cache' and 'value_cache' dimension 2 (kv num heads) should be the same, "
            f"got {kc[2]} and {vc[2]}"
        ),
    )
    r.dim_is("1.5.9", "value_cache", vc, 2, kvh, lambda got: f"Input 'value_cache' shall have kv_num_heads, got {got}")
    r.same(
        "1.5.10",
        "value_cache",
        ("key_cache dim 3", raw(kc, 3)),
        ("value_cache dim 3", raw(vc, 3)),
        lambda: (
            f"Input 'key_cache' and 'value_cache' dimension 3 (head size) should be the same, got {kc[3]} and {vc[3]}"
        ),
    )
    last_dim_rule("value_cache", dim(vc, 3))
    return nb, bs


def check_sequences(has: dict, shp: dict, tok: int | str | None, r: Rules) -> tuple[int | None, int | None]:
    """§1.6 sequence tensors, block table and slot mapping; returns ``(batch_size, max_blocks_per_seq)``."""
    cum, past, bt = shp["cumulative_sequence_length"], shp["past_seqlens"], shp["block_table"]
    batch_size = None
    if cum is None or (len(cum) == 1 and not isinstance(cum[0], int)):
        r.unchecked.append(("1.6.1", "needs the shape of cumulative_sequence_length, which is not known"))
    elif len(cum) != 1 or cum[0] < 2:
        r.fail("1.6.1", "cumulative_sequence_length", "cumulative_sequence_length must be shape (batch_size + 1).")
    else:
        batch_size = cum[0] - 1
    if past is not None and len(past) != 1:
        r.fail("1.6.2", "past_seqlens", "seqlens must be shape (batch_size).")
    r.check(
        "1.6.2",
        "past_seqlens",
        {"batch_size": batch_size, "past_seqlens dim 0": dim(past, 0)},
        lambda: past[0] != batch_size,
        lambda: "seqlens must be shape (batch_size).",
    )
    r.has_rank("1.6.3", "block_table", bt, 2, lambda n: "block_table must be 2D.")
    r.check(
        "1.6.4",
        "block_table",
        {"batch_size": batch_size, "block_table dim 0": dim(bt, 0)},
        lambda: bt[0] != batch_size,
        lambda: f"block_table dimension 0 should be batch_size, got {bt[0]}",
    )
    max_blocks = dim(bt, 1)
    r.check(
        "1.6.5",
        "block_table",
        {"block_table dim 1": max_blocks},
        lambda: max_blocks == 0,
        lambda: "block_table dimension 1 must be positive, got 0",
    )
    if has["slot_mapping"]:
        sm = shp["slot_mapping"]
        r.has_rank("1.6.6", "slot_mapping", sm, 1)
        r.same(
            "1.6.7",
            "slot_mapping",
            ("token_count", tok),
            ("slot_mapping dim 0", raw(sm, 0)),
            lambda: f"Input 'slot_mapping' dimension 0 should be token_count ({tok}), got {sm[0]}",
        )
    return batch_size, max_blocks
