"""The NumPy oracle against naive, separately written references (loops over tokens and heads are fine here)."""

from __future__ import annotations

import hashlib
import math

import ml_dtypes
import numpy as np
import pytest
from support.tolerances import assert_close

from ortpa.errors import InvalidArgument, NotImplementedByBackend
from ortpa.ops.oracle import paged_attention
from ortpa.ops.oracle.rope import apply_rotary, rms_norm

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16]
DT_IDS = ["fp16", "bf16"]


# --- naive references -------------------------------------------------------------------------------------


def naive_attention(q, k, v, past, *, scale, causal=True, window=-1, softcap=0.0, sink=None, key_ok=None):
    """One sequence, contiguous float64 K/V: q [q_len, N, H], k/v [L, kvh, *]; loops over tokens and heads."""
    q_len, n, _ = q.shape
    total, kvh = k.shape[0], k.shape[1]
    out = np.zeros((q_len, n, v.shape[-1]))
    for i in range(q_len):
        p = past + i
        hi = p + 1 if causal else total
        lo = max(0, p - window + 1) if window > 0 else 0
        js = [j for j in range(lo, min(hi, total)) if key_ok is None or key_ok[j]]
        for h in range(n):
            kv = h // (n // kvh)
            logits = [float(np.dot(q[i, h], k[j, kv])) * scale for j in js]
            if softcap > 0:
                logits = [softcap * math.tanh(x / softcap) for x in logits]
            extra = [float(sink[h])] if sink is not None else []
            if not js:
                continue
            m = max(logits + extra)
            w = [math.exp(x - m) for x in logits]
            den = sum(w) + sum(math.exp(x - m) for x in extra)
            out[i, h] = sum(wj * v[j, kv] for wj, j in zip(w, js, strict=True)) / den
    return out


def rope_direct(x, positions, theta, offset, interleaved):
    """x [T, heads, H] float64; rotate channels [offset, offset + 2*len(theta)) by angle pos*theta."""
    y = x.copy()
    for t, pos in enumerate(positions):
        for i, th in enumerate(theta):
            c, s = math.cos(pos * th), math.sin(pos * th)
            a, b = (offset + 2 * i, offset + 2 * i + 1) if interleaved else (offset + i, offset + len(theta) + i)
            y[t, :, a] = x[t, :, a] * c - x[t, :, b] * s
            y[t, :, b] = x[t, :, b] * c + x[t, :, a] * s
    return y


def rope_tables(rows, half, dt):
    theta = 1.0 / (10000.0 ** (np.arange(half) / half))
    ang = np.arange(rows)[:, None] * theta[None, :]
    return theta, np.cos(ang).astype(dt), np.sin(ang).astype(dt)


# --- building paged inputs from dense per-sequence data ---------------------------------------------------


def place(dense_per_seq, block_table, num_blocks, bs, fill):
    """Write each sequence's dense rows [L_b, kvh, W] into a fresh paged cache following block_table."""
    cache = fill.copy()
    for b, rows in enumerate(dense_per_seq):
        for j in range(rows.shape[0]):
            cache[block_table[b, j // bs], j % bs] = rows[j]
    return cache


class Case:
    """Random sequences with known past K/V placed in a paged cache (random garbage elsewhere)."""

    def __init__(self, dt, past, qlen, *, n=4, kvh=2, h=32, bs=16, seed=0, spare_blocks=3, permute=True):
        rng = np.random.default_rng(seed)
        self.dt, self.past, self.qlen, self.n, self.kvh, self.h, self.bs = dt, past, qlen, n, kvh, h, bs
        b = len(past)
        self.max_blocks = max(-(-(p + q) // bs) for p, q in zip(past, qlen, strict=True))
        self.num_blocks = b * self.max_blocks + spare_blocks
        ids = rng.permutation(self.num_blocks)  # drawn either way so that `permute` does not change the data
        ids = ids if permute else np.arange(self.num_blocks)
        self.block_table = ids[: b * self.max_blocks].reshape(b, self.max_blocks).astype(np.int32)
        t = sum(qlen)
        self.query = rng.standard_normal((t, n * h)).astype(dt)
        self.key = rng.standard_normal((t, kvh * h)).astype(dt)
        self.value = rng.standard_normal((t, kvh * h)).astype(dt)
        self.past_k = [rng.standard_normal((p, kvh, h)).astype(dt) for p in past]
        self.past_v = [rng.standard_normal((p, kvh, h)).astype(dt) for p in past]
        shape = (self.num_blocks, bs, kvh, h)
        self.key_cache = place(
            self.past_k, self.block_table, self.num_blocks, bs, rng.standard_normal(shape).astype(dt)
        )
        self.value_cache = place(
            self.past_v, self.block_table, self.num_blocks, bs, rng.standard_normal(shape).astype(dt)
        )
        self.cu = np.concatenate([[0], np.cumsum(qlen)]).astype(np.int32)
        self.past_seqlens = np.array(past, np.int32)

    def args(self):
        return (self.query, self.key, self.value, self.key_cache, self.value_cache, self.cu, self.past_seqlens,
                self.block_table)  # fmt: skip

    def run(self, **kw):
        kw.setdefault("num_heads", self.n)
        kw.setdefault("kv_num_heads", self.kvh)
        return paged_attention(*self.args(), **kw)

    def seq(self, b):
        return slice(int(self.cu[b]), int(self.cu[b + 1]))

    def dense(self, b, k_new=None, v_new=None):
        """Float64 contiguous K/V of sequence b: the placed past followed by its new tokens."""
        s = self.seq(b)
        kn = self.key[s] if k_new is None else k_new[s]
        vn = self.value[s] if v_new is None else v_new[s]
        k = np.concatenate([self.past_k[b], kn.reshape(-1, self.kvh, self.h)]).astype(np.float64)
        v = np.concatenate([self.past_v[b], vn.reshape(-1, self.kvh, self.h)]).astype(np.float64)
        return k, v

    def qs(self, b, q=None):
        return (self.query if q is None else q)[self.seq(b)].astype(np.float64).reshape(-1, self.n, self.h)


# prefill from 0, decode crossing a block boundary (past 16 -> position 16), chunk crossing 32
MIXED = dict(past=[0, 16, 30], qlen=[5, 1, 4])


def digest(*arrays):
    h = hashlib.sha256()
    for a in arrays:
        if a is not None:
            h.update(np.ascontiguousarray(a).view(np.uint8).tobytes())
            h.update(str((a.dtype, a.shape)).encode())
    return h.hexdigest()


# --- dense-attention parity -------------------------------------------------------------------------------

MODES = {
    "mha": dict(kvh=4, attrs={}),
    "gqa": dict(kvh=2, attrs={}),
    "window": dict(kvh=2, attrs={"local_window_size": 3}),
    "softcap": dict(kvh=2, attrs={"softcap": 2.0, "scale": 0.5}),
    "noncausal": dict(kvh=1, attrs={"is_causal": 0}),
    "noncausal_window": dict(kvh=2, attrs={"is_causal": 0, "local_window_size": 2}),
}


@pytest.mark.parametrize("dt", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_matches_naive_attention(dt, mode):
    cfg = MODES[mode]
    c = Case(dt, **MIXED, kvh=cfg["kvh"], seed=1)
    attrs = cfg["attrs"]
    out, kc, vc = c.run(**attrs)
    assert out.dtype == dt and out.shape == (sum(c.qlen), c.n * c.h)
    scale = attrs.get("scale", 1 / math.sqrt(c.h))
    for b in range(3):
        k, v = c.dense(b)
        ref = naive_attention(
            c.qs(b), k, v, c.past[b], scale=scale, causal=attrs.get("is_causal", 1) == 1,
            window=attrs.get("local_window_size", -1), softcap=attrs.get("softcap", 0.0),
        )  # fmt: skip
        assert_close(out[c.seq(b)], ref.reshape(-1, c.n * c.h), dt, what=f"{mode} sequence {b}")
        # the new K/V landed at positions [past, past + q_len) of the sequence's pages
        for i in range(c.qlen[b]):
            p = c.past[b] + i
            blk, off = c.block_table[b, p // c.bs], p % c.bs
            np.testing.assert_array_equal(kc[blk, off], c.key[c.seq(b)][i].reshape(c.kvh, c.h))
            np.testing.assert_array_equal(vc[blk, off], c.value[c.seq(b)][i].reshape(c.kvh, c.h))


@pytest.mark.parametrize("dt", DTYPES, ids=DT_IDS)
def test_packed_qkv_equals_separate(dt):
    c = Case(dt, **MIXED, kvh=2, seed=2)
    packed = np.concatenate([c.query, c.key, c.value], axis=1)
    a = c.run()
    b = paged_attention(packed, None, None, *c.args()[3:], num_heads=c.n, kv_num_heads=c.kvh)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_noncausal_window_is_anchored_at_query():
    # reference §10: expected mean over [max(0, p + 1 - W), past + len) with constant logits
    c = Case(np.dtype(np.float16), past=[6], qlen=[4], n=1, kvh=1, seed=3)
    c.query[:] = 0
    out, _, _ = c.run(is_causal=0, local_window_size=3)
    _, v = c.dense(0)
    for i in range(4):
        p = 6 + i
        expect = v[max(0, p + 1 - 3) : 10, 0].mean(axis=0)
        assert_close(out[i], expect, c.dt, what=f"query {i}")


# --- paging: placement, slots, unmapped pages ------------------------------------------------------------


@pytest.mark.parametrize("dt", DTYPES, ids=DT_IDS)
def test_block_table_placement_invariance(dt):
    a = Case(dt, **MIXED, seed=4, permute=False)
    b = Case(dt, **MIXED, seed=4, permute=True)  # same data, pages scattered differently
    assert not np.array_equal(a.block_table, b.block_table)
    out_a, kc_a, _ = a.run()
    out_b, kc_b, _ = b.run()
    np.testing.assert_array_equal(out_a, out_b)
    # the logical content of each sequence (its first past + q_len rows) is identical after the write
    for s in range(3):
        live = a.past[s] + a.qlen[s]
        rows_a = kc_a[a.block_table[s]].reshape(-1, a.kvh, a.h)[:live]
        np.testing.assert_array_equal(rows_a, kc_b[b.block_table[s]].reshape(-1, b.kvh, b.h)[:live])


@pytest.mark.parametrize("dt", DTYPES, ids=DT_IDS)
def test_slot_mapping_minus_one_skips_write(dt):
    # reference §3.5: past=1, 2 new tokens, block_table [[0,1]], slot_mapping [1,-1]
    rng = np.random.default_rng(5)
    n, kvh, h, bs = 2, 2, 16, 16
    q = rng.standard_normal((2, n * h)).astype(dt)
    k = rng.standard_normal((2, kvh * h)).astype(dt)
    v = rng.standard_normal((2, kvh * h)).astype(dt)
    kc = rng.standard_normal((2, bs, kvh, h)).astype(dt)
    vc = rng.standard_normal((2, bs, kvh, h)).astype(dt)
    idx = (np.array([0, 2], np.int32), np.array([1], np.int32), np.array([[0, 1]], np.int32))
    out, kc2, vc2 = paged_attention(q, k, v, kc, vc, *idx, slot_mapping=np.array([1, -1], np.int32),
                                    num_heads=n, kv_num_heads=kvh)  # fmt: skip
    ek, ev = kc.copy(), vc.copy()
    ek[0, 1], ev[0, 1] = k[0].reshape(kvh, h), v[0].reshape(kvh, h)
    np.testing.assert_array_equal(kc2.view(np.uint8), ek.view(np.uint8))
    np.testing.assert_array_equal(vc2.view(np.uint8), ev.view(np.uint8))
    # token 1 (position 2) still attends; it reads the untouched slot 2
    kd = np.concatenate([kc[0, :1], k[:1].reshape(1, kvh, h), kc[0, 2:3]]).astype(np.float64)
    vd = np.concatenate([vc[0, :1], v[:1].reshape(1, kvh, h), vc[0, 2:3]]).astype(np.float64)
    ref = naive_attention(q.astype(np.float64).reshape(2, n, h), kd, vd, 1, scale=1 / math.sqrt(h))
    assert_close(out, ref.reshape(2, -1), dt, what="slot_mapping -1")
    # out-of-range slots are skipped too
    _, kc3, _ = paged_attention(q, k, v, kc, vc, *idx, slot_mapping=np.array([-1, 2 * bs], np.int32),
                                num_heads=n, kv_num_heads=kvh)  # fmt: skip
    np.testing.assert_array_equal(kc3.view(np.uint8), kc.view(np.uint8))


def test_default_slots_equal_explicit_slot_mapping():
    c = Case(BF16, **MIXED, seed=6)
    slots = []
    for b in range(3):
        for i in range(c.qlen[b]):
            p = c.past[b] + i
            slots.append(c.block_table[b, p // c.bs] * c.bs + p % c.bs)
    derived = c.run()
    explicit = c.run(slot_mapping=np.array(slots, np.int32))
    for x, y in zip(derived, explicit, strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("dt", DTYPES, ids=DT_IDS)
def test_unmapped_page_in_range_is_masked(dt):
    c = Case(dt, past=[40], qlen=[2], n=2, kvh=1, seed=7)
    bt = c.block_table.copy()
    bt[0, 1] = -1  # positions 16..31 unmapped
    out, _, _ = paged_attention(*c.args()[:7], bt, num_heads=2, kv_num_heads=1)
    k, v = c.dense(0)
    ok = np.ones(42, bool)
    ok[16:32] = False
    ref = naive_attention(c.qs(0), k, v, 40, scale=1 / math.sqrt(c.h), key_ok=ok)
    assert_close(out, ref.reshape(2, -1), dt, what="-1 page masked")


# --- prologue: RoPE, QK-norm, head sink ---------------------------------------------------------------------


@pytest.mark.parametrize("dt", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize(("half", "offset"), [(16, 0), (8, 0), (8, 16)], ids=["full", "partial", "offset"])
def test_rotary_against_direct_formula(dt, interleaved, half, offset):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((6, 3, 32)).astype(dt)
    theta, cos, sin = rope_tables(64, half, dt)
    pos = np.array([0, 1, 5, 17, 40, 63])
    got = apply_rotary(x, cos, sin, pos, interleaved=bool(interleaved), rotary_offset=offset)
    ref = rope_direct(x.astype(np.float64), pos, theta, offset, interleaved)
    assert_close(got, ref, dt, what="rope")
    outside = np.ones(32, bool)
    outside[offset : offset + 2 * half] = False
    np.testing.assert_array_equal(got[..., outside], x[..., outside])  # copied through untouched


@pytest.mark.parametrize("dt", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("interleaved", [0, 1])
def test_oracle_rope_and_qk_norm_positions(dt, interleaved):
    c = Case(dt, **MIXED, h=32, seed=9)
    theta, cos, sin = rope_tables(64, 8, dt)  # partial rotary_dim 16 at offset 16
    rng = np.random.default_rng(10)
    wq = rng.uniform(0.5, 1.5, 32).astype(dt)
    wk = rng.uniform(0.5, 1.5, 32).astype(dt)
    out, kc, _ = c.run(cos_cache=cos, sin_cache=sin, q_norm_weight=wq, k_norm_weight=wk, do_rotary=1,
                       rotary_interleaved=interleaved, rotary_offset=16)  # fmt: skip

    def norm(x, w):  # direct RMSNorm per head in float64, rounded to T as the kernel does
        x = x.astype(np.float64).reshape(x.shape[0], -1, 32)
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6) * w.astype(np.float64)
        return y.astype(dt).astype(np.float64)

    for b in range(3):
        s = c.seq(b)
        positions = np.arange(c.past[b], c.past[b] + c.qlen[b])
        qr = rope_direct(norm(c.query[s], wq), positions, theta, 16, interleaved)
        kr = rope_direct(norm(c.key[s], wk), positions, theta, 16, interleaved)
        k, v = c.dense(b)
        k[c.past[b] :] = kr
        ref = naive_attention(qr, k, v, c.past[b], scale=1 / math.sqrt(32))
        assert_close(out[s], ref.reshape(-1, c.n * 32), dt, what=f"rope+norm sequence {b}")
        blk, off = c.block_table[b, c.past[b] // c.bs], c.past[b] % c.bs
        assert_close(kc[blk, off], kr[0], dt, what="cached key is normalised then rotated")


def test_rotary_position_outside_cos_rows_raises():
    # CUDA reads out of bounds; the oracle refuses instead of inventing a value
    _, cos, sin = rope_tables(8, 8, np.float16)
    x = np.zeros((2, 1, 16), np.float16)
    with pytest.raises(ValueError, match=r"positions in \[0, 8\)"):
        apply_rotary(x, cos, sin, np.array([3, 8]), interleaved=False)


def test_rms_norm_direct():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((4, 3, 16)).astype(BF16)
    w = rng.uniform(0.5, 2, 16).astype(BF16)
    xf = x.astype(np.float64)
    ref = xf / np.sqrt((xf * xf).mean(-1, keepdims=True) + 1e-5) * w.astype(np.float64)
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == BF16
    assert_close(got, ref, BF16, what="rms_norm")


@pytest.mark.parametrize("dt", DTYPES, ids=DT_IDS)
def test_head_sink_is_an_extra_logit(dt):
    c = Case(dt, past=[5], qlen=[1], n=2, kvh=1, h=16, seed=12)
    sink = np.array([0.5, -1.0], dt)
    out, _, _ = c.run(head_sink=sink)
    k, v = c.dense(0)
    q = c.qs(0)[0]
    for h in range(2):
        logits = k[:, 0] @ q[h] / 4.0
        e = np.exp(np.append(logits, float(sink[h])))
        expect = (e[:-1] / e.sum()) @ v[:, 0]
        assert_close(out[0, h * 16 : (h + 1) * 16], expect, dt, what=f"sink head {h}")


def test_empty_key_range_gives_zeros_even_with_sink():
    c = Case(np.dtype(np.float16), past=[3], qlen=[2], n=2, kvh=1, h=16, seed=13)
    bt = np.full_like(c.block_table, -1)  # nothing mapped: no writes, every key masked
    out, kc, _ = paged_attention(*c.args()[:7], bt, head_sink=np.array([1.0, 2.0], np.float16),
                                 num_heads=2, kv_num_heads=1)  # fmt: skip
    assert np.all(out == 0) and not np.isnan(out.astype(np.float32)).any()
    np.testing.assert_array_equal(kc, c.key_cache)


# --- sanitization at op level ---------------------------------------------------------------------------------


def test_invalid_sequences_give_zero_rows_and_no_writes():
    c = Case(np.dtype(np.float16), past=[4, 2], qlen=[2, 3], seed=14)
    cap = c.max_blocks * c.bs
    past = np.array([-1, cap], np.int32)  # negative; no room for 3 tokens
    out, kc, vc = paged_attention(*c.args()[:6], past, c.block_table, num_heads=c.n, kv_num_heads=c.kvh)
    assert np.all(out == 0)
    np.testing.assert_array_equal(kc, c.key_cache)
    np.testing.assert_array_equal(vc, c.value_cache)
    # one bad sequence does not disturb the other
    past = np.array([4, -7], np.int32)
    out, kc, _ = paged_attention(*c.args()[:6], past, c.block_table, num_heads=c.n, kv_num_heads=c.kvh)
    assert np.all(out[2:] == 0) and np.any(out[:2] != 0)
    k, v = c.dense(0)
    ref = naive_attention(c.qs(0), k, v, 4, scale=1 / math.sqrt(c.h))
    assert_close(out[:2], ref.reshape(2, -1), c.dt, what="valid sequence next to an invalid one")


def test_malformed_block_table_entries_are_unmapped():
    c = Case(np.dtype(np.float16), past=[20], qlen=[1], n=2, kvh=1, seed=15)
    bt = c.block_table.copy()
    bt[0, 0] = c.num_blocks + 5  # out of range -> -1 -> positions 0..15 masked
    out, _, _ = paged_attention(*c.args()[:7], bt, num_heads=2, kv_num_heads=1)
    k, v = c.dense(0)
    ok = np.arange(21) >= 16
    ref = naive_attention(c.qs(0), k, v, 20, scale=1 / math.sqrt(c.h), key_ok=ok)
    assert_close(out, ref.reshape(1, -1), c.dt, what="sanitized block table")


def test_overflowing_prefill_writes_and_reads_only_capacity():
    # q_len > capacity with past 0 stays valid (§10): positions >= capacity are neither written nor attended
    c = Case(np.dtype(np.float16), past=[0], qlen=[20], n=2, kvh=1, h=16, seed=23, spare_blocks=0)
    bt = c.block_table[:, :1]  # capacity 16
    out, kc, _ = paged_attention(*c.args()[:7], bt, num_heads=2, kv_num_heads=1)
    k, v = c.dense(0)
    ref = naive_attention(c.qs(0), k[:16], v[:16], 0, scale=0.25)
    assert_close(out, ref.reshape(20, -1), c.dt, what="capacity-capped prefill")
    np.testing.assert_array_equal(kc[bt[0, 0]], c.key[:16].reshape(16, 1, 16))
    untouched = np.setdiff1d(np.arange(c.num_blocks), bt[0])
    np.testing.assert_array_equal(kc[untouched], c.key_cache[untouched])


def test_latent_int4_is_not_implemented():
    args, _, attrs, _, _ = mla_case(BF16, 2, 32, 16, 16, 16, 3, 1, 16, 24, 0)
    query, key, _, kc, _, cu, past, bt = args
    packed = np.zeros((*kc.shape[:3], 24), np.uint8)
    with pytest.raises(NotImplementedByBackend, match="int4"):
        paged_attention(query, key, None, packed, None, cu, past, bt, k_scale=np.ones(1, np.float32),
                        k_quant_type="PER_TENSOR", k_cache_dtype="int4", **attrs)  # fmt: skip


def test_token_count_zero():
    c = Case(np.dtype(np.float16), past=[3], qlen=[0], n=2, kvh=1, seed=16)
    out, kc, _ = c.run()
    assert out.shape == (0, 2 * c.h)
    np.testing.assert_array_equal(kc, c.key_cache)


def test_validation_runs_first():
    c = Case(np.dtype(np.float16), past=[3], qlen=[1], n=4, kvh=2, seed=17)
    with pytest.raises(InvalidArgument, match="num_heads % kv_num_heads"):
        paged_attention(*c.args(), num_heads=4, kv_num_heads=3)


# --- quantized caches -------------------------------------------------------------------------------------------

QMAX = {"int8": 127.0, "float8e4m3fn": 448.0, "int4": 7.0}
STORE = {"int8": np.int8, "float8e4m3fn": ml_dtypes.float8_e4m3fn, "int4": np.uint8}


def quant_ref(x, s, kind):
    """Test-side symmetric quantize -> dequantize in float64 (independent of ortpa.ops.oracle.quant)."""
    r = np.clip(x.astype(np.float32) / s, -QMAX[kind] - (kind == "int8") - (kind == "int4"), QMAX[kind])
    q = r.astype(ml_dtypes.float8_e4m3fn).astype(np.float64) if kind == "float8e4m3fn" else np.rint(r)
    return q * s


def store(x, s, kind):
    """Encode x (float64 [..., kvh, H]) the way the cache holds it, for placing the past."""
    r = np.clip(x / s, -QMAX[kind] - (kind != "float8e4m3fn"), QMAX[kind]).astype(np.float32)
    if kind == "float8e4m3fn":
        return r.astype(ml_dtypes.float8_e4m3fn)
    q = np.rint(r).astype(np.int16)
    if kind == "int8":
        return q.astype(np.int8)
    nib = (q + 8).astype(np.uint8)
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


@pytest.mark.parametrize("dt", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("kind", ["int8", "float8e4m3fn", "int4"])
@pytest.mark.parametrize("qt", ["PER_TENSOR", "PER_CHANNEL"])
def test_quantized_cache(dt, kind, qt):
    c = Case(dt, **MIXED, n=4, kvh=2, h=16, seed=18)
    rng = np.random.default_rng(19)
    if qt == "PER_TENSOR":
        ks, vs = np.array([3.0 / QMAX[kind]], np.float32), np.array([2.5 / QMAX[kind]], np.float32)
    else:
        ks = rng.uniform(2.0, 4.0, (2, 1, 16)).astype(np.float32) / QMAX[kind]
        vs = rng.uniform(2.0, 4.0, (2, 1, 16)).astype(np.float32) / QMAX[kind]
    ksb, vsb = ks.reshape(-1, 16) if qt == "PER_CHANNEL" else ks, vs.reshape(-1, 16) if qt == "PER_CHANNEL" else vs
    # past rows enter the cache already quantized; the reference sees their dequantized values
    past_k = [quant_ref(p.astype(np.float64), ksb, kind) for p in c.past_k]
    past_v = [quant_ref(p.astype(np.float64), vsb, kind) for p in c.past_v]
    width = 8 if kind == "int4" else 16
    fill = np.zeros((c.num_blocks, c.bs, 2, width), STORE[kind])
    kc = place([store(p, ksb, kind) for p in c.past_k], c.block_table, c.num_blocks, c.bs, fill)
    vc = place([store(p, vsb, kind) for p in c.past_v], c.block_table, c.num_blocks, c.bs, fill)
    attrs = dict(k_quant_type=qt, v_quant_type=qt)
    if kind == "int4":
        attrs.update(k_cache_dtype="int4", v_cache_dtype="int4")
    out, kc2, _ = paged_attention(c.query, c.key, c.value, kc, vc, c.cu, c.past_seqlens, c.block_table,
                                    k_scale=ks, v_scale=vs, num_heads=4, kv_num_heads=2, **attrs)  # fmt: skip
    assert kc2.dtype == kc.dtype and kc2.shape == kc.shape
    for b in range(3):
        s = c.seq(b)
        kn = quant_ref(c.key[s].astype(np.float64).reshape(-1, 2, 16), ksb, kind)
        vn = quant_ref(c.value[s].astype(np.float64).reshape(-1, 2, 16), vsb, kind)
        k = np.concatenate([past_k[b], kn])
        v = np.concatenate([past_v[b], vn])
        ref = naive_attention(c.qs(b), k, v, c.past[b], scale=0.25)
        assert_close(out[s], ref.reshape(-1, 64), dt, what=f"{kind} {qt} sequence {b}")
        p = c.past[b]
        got = kc2[c.block_table[b, p // c.bs], p % c.bs]
        want = store(c.key[s][0].astype(np.float64).reshape(2, 16), ksb, kind)
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


# --- LATENT (absorbed MLA) ----------------------------------------------------------------------------------------


def mla_case(dt, n, lora, nope, rope, vdim, past, qlen, bs, seed, do_rotary):
    rng = np.random.default_rng(seed)
    ctx = past + qlen
    q_nope = rng.standard_normal((qlen, n, nope)) * 0.5
    q_pe = rng.standard_normal((qlen, n, rope)) * 0.5
    ckv = rng.standard_normal((ctx, lora)) / math.sqrt(lora) * 3
    k_pe = rng.standard_normal((ctx, rope)) * 0.5
    w_uk = rng.standard_normal((n, nope, lora)) / math.sqrt(lora) * 2  # [N, P, L] (vLLM W_UK_T)
    w_uv = rng.standard_normal((n, lora, vdim)) / math.sqrt(lora)  # [N, L, V]
    # round what the op receives to T; the decomposed reference uses the same rounded latent rows
    ckv, k_pe = ckv.astype(dt).astype(np.float64), k_pe.astype(dt).astype(np.float64)
    q_nope, q_pe = q_nope.astype(dt).astype(np.float64), q_pe.astype(dt).astype(np.float64)
    scale = 1 / math.sqrt(nope + rope)
    positions = np.arange(past, ctx)
    theta, cos, sin = rope_tables(ctx + 4, rope // 2, dt)
    if do_rotary:  # RoPE is the op's job: the cache holds un-rotated past rows here rotated by the test
        k_pe_all = rope_direct(k_pe[:, None, :], np.arange(ctx), theta, 0, True)[:, 0]
        q_pe_rot = rope_direct(q_pe, positions, theta, 0, True)
    else:
        k_pe_all, q_pe_rot = k_pe, q_pe
    # decomposed multi-head MLA (float64)
    k_nope = np.einsum("npl,jl->jnp", w_uk, ckv)
    v_full = np.einsum("nlv,jl->jnv", w_uv, ckv)
    k_mh = np.concatenate([k_nope, np.broadcast_to(k_pe_all[:, None, :], (ctx, n, rope))], axis=-1)
    q_mh = np.concatenate([q_nope, q_pe_rot], axis=-1)
    ref = naive_attention(q_mh, k_mh, v_full, past, scale=scale)
    # absorbed PagedAttention LATENT inputs
    q_lat = np.einsum("tnp,npl->tnl", q_nope, w_uk)
    query = np.concatenate([q_lat, q_pe], axis=-1).reshape(qlen, -1).astype(dt)
    key = np.concatenate([ckv[past:], k_pe[past:]], axis=-1).astype(dt)
    max_blocks = -(-ctx // bs) + 1
    bt = rng.permutation(max_blocks + 2)[:max_blocks].reshape(1, -1).astype(np.int32)
    rows = np.concatenate([ckv[:past], k_pe_all[:past] if do_rotary else k_pe[:past]], axis=-1)[:, None, :]
    kc = place([rows.astype(dt)], bt, max_blocks + 2, bs, np.zeros((max_blocks + 2, bs, 1, lora + rope), dt))
    args = (query, key, None, kc, None, np.array([0, qlen], np.int32), np.array([past], np.int32), bt)
    attrs = dict(num_heads=n, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=lora, scale=scale)
    if do_rotary:
        attrs.update(do_rotary=1, rotary_interleaved=1, rotary_offset=lora)
        return args, dict(cos_cache=cos, sin_cache=sin), attrs, ref, w_uv
    return args, {}, attrs, ref, w_uv


@pytest.mark.parametrize("dt", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize(
    ("dims", "past", "qlen", "do_rotary"),
    [((2, 32, 16, 16, 16), 5, 4, 1), ((3, 32, 16, 16, 16), 19, 1, 0), ((4, 512, 128, 64, 128), 37, 3, 1)],
    ids=["tiny_prefill_rope", "tiny_decode", "deepseek_v3"],
)
def test_latent_equals_decomposed_mla(dt, dims, past, qlen, do_rotary):
    n, lora, nope, rope, vdim = dims
    args, opt, attrs, ref, w_uv = mla_case(dt, n, lora, nope, rope, vdim, past, qlen, 16, 20, do_rotary)
    out, _, vc = paged_attention(*args, **opt, **attrs)
    assert vc is None and out.shape == (qlen, n * lora) and out.dtype == dt
    lat = out.astype(np.float64).reshape(qlen, n, lora)
    got = np.einsum("tnl,nlv->tnv", lat, w_uv)
    assert_close(got, ref, dt, what="absorbed LATENT vs decomposed MLA")


@pytest.mark.parametrize("kind", ["int8", "float8e4m3fn"])
def test_latent_quantized_value_is_key_prefix(kind):
    # V must be the dequantized leading channels of the same cached row, scaled by k_scale
    args, _, attrs, _, _ = mla_case(BF16, 2, 32, 16, 16, 16, 6, 2, 16, 21, 0)
    query, key, _, kc, _, cu, past, bt = args
    ks = np.array([4.0 / QMAX[kind]], np.float32)
    kcq = store(kc.astype(np.float64), ks, kind)
    out, _, _ = paged_attention(query, key, None, kcq, None, cu, past, bt, k_scale=ks, k_quant_type="PER_TENSOR",
                                  **attrs)  # fmt: skip
    rows = np.concatenate([kc[bt[0, j // 16], j % 16, 0].astype(np.float64)[None] for j in range(6)])
    rows = np.concatenate([quant_ref(rows, ks, kind), quant_ref(key.astype(np.float64), ks, kind)])
    q = query.astype(np.float64).reshape(2, 2, 48)
    ref = naive_attention(q, rows[:, None, :], rows[:, None, :32], 6, scale=attrs["scale"])
    assert_close(out, ref.reshape(2, -1), BF16, what=f"LATENT {kind}")


# --- inputs are never mutated ---------------------------------------------------------------------------------------


def test_inputs_never_mutated():
    c = Case(np.dtype(np.float16), **MIXED, h=32, seed=22)
    _, cos, sin = rope_tables(64, 16, np.float16)
    ks = np.array([0.05], np.float32)
    kcq = np.zeros(c.key_cache.shape, np.int8)
    extra = dict(cos_cache=cos, sin_cache=sin, head_sink=np.ones(4, np.float16),
                 q_norm_weight=np.ones(32, np.float16), k_norm_weight=np.ones(32, np.float16))  # fmt: skip
    slots = np.arange(10, dtype=np.int32)
    arrays = [*c.args(), kcq, ks, slots, *extra.values()]
    before = digest(*arrays)
    c.run(**extra, do_rotary=1, slot_mapping=slots)
    paged_attention(c.query, c.key, c.value, kcq, kcq.copy(), *c.args()[5:], **extra, k_scale=ks, v_scale=ks,
                    num_heads=4, kv_num_heads=2, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR")  # fmt: skip
    assert digest(*arrays) == before
