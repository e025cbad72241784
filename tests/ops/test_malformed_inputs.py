"""Malformed runtime inputs to the oracle and the portable op (issue 6, item 2).

Hypothesis builds a clean batch (disjoint blocks per sequence, so ownership is unambiguous), then corrupts one
or more sequences, combining: negative or too-large ``past_seqlens``, block-table entries outside
``[-1, num_blocks)`` or holes (-1) in the live range, non-monotone or out-of-range
``cumulative_sequence_length`` (ends included), duplicate or out-of-range ``slot_mapping`` entries, and
NaN/+-Inf in a corrupted sequence's query/key/value rows. Independently, spare (unowned) cache blocks may hold
NaN/Inf garbage, as uninitialised memory does. For every example, on both the oracle and the portable session:

1. nothing raises: malformed *values* are sanitized (reference §3.4(a)), never rejected;
2. oracle == portable: outputs within ``tests/tolerances.py`` with identical NaN masks; cache outputs
   identical byte for byte, except that two NaNs are equal whatever their payload/sign bits (NumPy and
   ONNX Runtime propagate NaN payloads differently; neither is meaningful);
3. every changed cache slot is one the sanitized batch lets a *valid* sequence write: derived here from the
   spec (own transcription of §3.4(a)/(c), not ``ortpa.ops.oracle.sanitize``): ``slot_mapping[t]`` when given, else
   ``block_table[b, p // bs] * bs + p % bs`` for the sequence's positions; invalid sequences output zeros;
4. sequences whose token range and inputs were not touched have outputs and cache blocks byte-identical to a
   run of the clean batch; blocks nobody owns are never written;
5. non-finite values never reach another sequence: every sequence that owns no non-finite input (and reads no
   slot a non-finite token wrote) has a finite output.

Duplicate write slots (two tokens of one call resolving to one cache slot, through ``slot_mapping`` or a block
table that repeats a block) are a write race on CUDA. ortpa makes both of its paths deterministic with the
same rule: **the last writer (highest token index) wins**; everything else is as without the duplicate. The
native kernel may leave any one writer's bytes there.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.iobind import bind_cpu
from support.tolerances import assert_close

from ortpa.ops.oracle import paged_attention
from ortpa.ops.portable import portable_single_node_model
from ortpa.ops.spec import PAGED_ATTENTION

pytestmark = pytest.mark.filterwarnings("error")  # a warning on bad data is a failure too

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16]
_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1

# Small dims keep one example at a few milliseconds; LATENT: 32-wide rows, values = leading 16 channels.
LAYOUTS = {
    "SEPARATE": dict(num_heads=4, kv_num_heads=2, head_size=32, v_head_size=32),
    "LATENT": dict(num_heads=2, kv_num_heads=1, head_size=32, v_head_size=16),
    # SEPARATE with 4 KiB cache rows: large enough that ONNX Runtime's ScatterND copies rows in parallel, so
    # duplicate write slots race unless the op removes them
    "WIDE": dict(num_heads=8, kv_num_heads=8, head_size=256, v_head_size=256),
}
GENERATED_LAYOUTS = ["LATENT", "SEPARATE"]
# cos/sin width must be a multiple of 8 (ONNX Runtime rule 1.7.8)
ROTARY = {"SEPARATE": (16, False, 8), "LATENT": (16, True, 16)}  # (rotary_dim, interleaved, rotary_offset)
KINDS = (
    "past_negative",
    "past_too_large",
    "block_out_of_range",
    "block_hole",
    "cu",
    "slot_duplicate",
    "slot_out_of_range",
    "nonfinite",
)


@dataclass(frozen=True)
class Sig:
    """What a portable session is specialised on; every other dimension is symbolic in the model."""

    dtype: np.dtype
    layout: str
    slots: bool
    rotary: bool

    def attrs(self) -> dict:
        d = LAYOUTS[self.layout]
        a: dict = {"num_heads": d["num_heads"], "kv_num_heads": d["kv_num_heads"]}
        if self.layout == "LATENT":
            a.update(kv_cache_layout="LATENT", v_head_size=d["v_head_size"], scale=0.3)
        if self.rotary:
            a.update(do_rotary=1, rotary_interleaved=int(ROTARY[self.layout][1]))
            if ROTARY[self.layout][2]:
                a["rotary_offset"] = ROTARY[self.layout][2]
        return a


@dataclass
class Batch:
    sig: Sig
    inputs: dict  # schema name -> array (clean or corrupted)
    q_lens: list[int]  # clean
    pasts: list[int]  # clean
    owned_blocks: list[list[int]]  # clean block ids per sequence (disjoint)
    block_size: int
    kinds: dict[int, list[str]] = field(default_factory=dict)  # corrupted sequence -> corruption kinds

    @property
    def clean_cu(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int64)


# ------------------------------------------------------------------------------------------------ sessions
_SESSIONS: dict[Sig, ort.InferenceSession] = {}


def session(b: Batch) -> ort.InferenceSession:
    """One session per signature: token, batch, block and row counts are symbolic in the model."""
    if b.sig not in _SESSIONS:
        model = portable_single_node_model(b.inputs, b.sig.attrs())
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        _SESSIONS[b.sig] = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return _SESSIONS[b.sig]


def run_portable(b: Batch, x: dict) -> dict[str, np.ndarray]:
    """IO binding (bfloat16 has no numpy path in ONNX Runtime) with fresh cache outputs; inputs stay untouched."""
    sess = session(b)
    io = sess.io_binding()
    keep = []
    for name, a in x.items():
        a = np.ascontiguousarray(a)
        keep.append(a)
        bind_cpu(io, name, a)
    width = LAYOUTS[b.sig.layout]["num_heads"] * LAYOUTS[b.sig.layout]["v_head_size"]
    outs = {"output": np.zeros((x["query"].shape[0], width), x["query"].dtype)}
    outs["key_cache_out"] = np.empty_like(x["key_cache"])
    if "value_cache" in x:
        outs["value_cache_out"] = np.empty_like(x["value_cache"])
    for name, arr in outs.items():
        bind_cpu(io, name, arr, output=True)
    sess.run_with_iobinding(io)
    return outs


def run_oracle(b: Batch, x: dict) -> dict[str, np.ndarray]:
    full = {name: x.get(name) for name in PAGED_ATTENTION.input_names}
    out, kc, vc = paged_attention(**full, **b.sig.attrs())
    got = {"output": out, "key_cache_out": kc}
    if vc is not None:
        got["value_cache_out"] = vc
    return got


# ------------------------------------------------------------------------------------------------ generation
@st.composite
def clean_batches(draw, sig: Sig, *, max_batch: int = 4, max_q: int = 5, max_past: int = 40) -> Batch:
    d = LAYOUTS[sig.layout]
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    nseq = draw(st.integers(1, max_batch))
    bs = draw(st.sampled_from([16, 32]))  # ONNX Runtime: a power of two >= 16
    q_lens = draw(st.lists(st.integers(0, max_q), min_size=nseq, max_size=nseq))
    pasts = draw(st.lists(st.integers(0, max_past), min_size=nseq, max_size=nseq))
    need = [-(-(p + q) // bs) for p, q in zip(pasts, q_lens, strict=True)]
    max_blocks = max(1, *need) + draw(st.integers(0, 1))
    spare = draw(st.integers(0 if sum(need) else 1, 2))
    num_blocks = sum(need) + spare
    perm = [int(v) for v in rng.permutation(num_blocks)]
    owned, at = [], 0
    bt = np.full((nseq, max_blocks), -1, np.int32)
    for s, k in enumerate(need):
        owned.append(perm[at : at + k])
        bt[s, :k] = owned[-1]
        at += k
    t = sum(q_lens)
    kvh, h = d["kv_num_heads"], d["head_size"]

    def act(*shape):
        return rng.standard_normal(shape).astype(sig.dtype)

    x: dict = {"query": act(t, d["num_heads"] * h), "key": act(t, kvh * h)}
    if sig.layout == "SEPARATE":
        x["value"] = act(t, kvh * h)
    x["key_cache"] = act(num_blocks, bs, kvh, h)
    if sig.layout == "SEPARATE":
        x["value_cache"] = act(num_blocks, bs, kvh, h)
    if draw(st.booleans()):  # uninitialised memory: unowned blocks hold NaN/Inf garbage
        for blk in perm[at:]:
            for name in ("key_cache", "value_cache"):
                if name in x:
                    x[name][blk] = rng.choice(np.array([np.nan, np.inf, -np.inf], np.float32), x[name][blk].shape)
    x["cumulative_sequence_length"] = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    x["past_seqlens"] = np.array(pasts, np.int32)
    x["block_table"] = bt
    if sig.rotary:
        rd = ROTARY[sig.layout][0]
        rows = max(max_blocks * bs, t) + 1  # every position a valid sequence can reach, even after re-attribution
        ang = rng.uniform(0, 2 * np.pi, (rows, rd // 2))
        x["cos_cache"], x["sin_cache"] = np.cos(ang).astype(sig.dtype), np.sin(ang).astype(sig.dtype)
    if sig.slots:
        sm = []
        for s, (p, q) in enumerate(zip(pasts, q_lens, strict=True)):
            sm += [int(bt[s, (p + i) // bs]) * bs + (p + i) % bs for i in range(q)]
        x["slot_mapping"] = np.array(sm, np.int32)
    return Batch(sig, x, q_lens, pasts, owned, bs)


@st.composite
def corrupt(draw, clean: Batch) -> Batch:
    """A copy of ``clean`` with one or more sequences corrupted in one or more ways."""
    x = {k: v.copy() for k, v in clean.inputs.items()}
    b = Batch(clean.sig, x, clean.q_lens, clean.pasts, clean.owned_blocks, clean.block_size)
    nseq, bs = len(clean.q_lens), clean.block_size
    num_blocks, max_blocks = x["key_cache"].shape[0], x["block_table"].shape[1]
    cap, t = max_blocks * bs, x["query"].shape[0]
    cu = clean.clean_cu
    kinds = [k for k in KINDS if clean.sig.slots or not k.startswith("slot")]
    victims = draw(st.lists(st.integers(0, nseq - 1), min_size=1, max_size=nseq, unique=True))
    for s in victims:
        q = clean.q_lens[s]
        toks = list(range(int(cu[s]), int(cu[s + 1])))
        chosen = draw(st.lists(st.sampled_from(kinds), min_size=1, max_size=3, unique=True))
        b.kinds[s] = chosen
        for kind in chosen:
            if kind == "past_negative":
                x["past_seqlens"][s] = draw(st.one_of(st.just(-1), st.integers(_I32_MIN, -1)))
            elif kind == "past_too_large":
                x["past_seqlens"][s] = draw(st.one_of(st.just(cap - q + 1), st.integers(cap - q + 1, _I32_MAX)))
            elif kind == "block_out_of_range":
                col = draw(st.integers(0, max_blocks - 1))
                x["block_table"][s, col] = draw(
                    st.one_of(st.just(num_blocks), st.integers(num_blocks, _I32_MAX), st.integers(_I32_MIN, -2))
                )
            elif kind == "block_hole":
                x["block_table"][s, draw(st.integers(0, max_blocks - 1))] = -1
            elif kind == "cu":
                at = draw(st.sampled_from([s, s + 1]))
                x["cumulative_sequence_length"][at] = draw(
                    st.one_of(st.integers(-3, t + 3), st.sampled_from([_I32_MIN, _I32_MAX]))
                )
            elif kind == "slot_duplicate" and toks:
                src = draw(st.sampled_from(toks))
                dst = draw(st.sampled_from(toks))
                if src != dst:
                    x["slot_mapping"][dst] = x["slot_mapping"][src]
                else:  # one token overwrites another slot of its own sequence (a past position, say)
                    own = [blk * bs + o for blk in clean.owned_blocks[s] for o in range(bs)]
                    x["slot_mapping"][dst] = draw(st.sampled_from(own))
            elif kind == "slot_out_of_range" and toks:
                x["slot_mapping"][draw(st.sampled_from(toks))] = draw(
                    st.one_of(
                        st.just(-1),
                        st.just(num_blocks * bs),
                        st.integers(num_blocks * bs, _I32_MAX),
                        st.integers(_I32_MIN, -1),
                    )
                )
            elif kind == "nonfinite" and toks:
                names = [n for n in ("query", "key", "value") if n in x]
                name = draw(st.sampled_from(names))
                tok = draw(st.sampled_from(toks))
                val = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
                if draw(st.booleans()):
                    x[name][tok] = val
                else:
                    x[name][tok, draw(st.integers(0, x[name].shape[1] - 1))] = val
    return b


# ------------------------------------------------------------------------------------------------ spec, restated
@dataclass
class Expected:
    """The sanitized batch, derived here from reference §3.4(a) without ``ortpa.ops.oracle.sanitize``."""

    cu: list[int]
    past: list[int]
    valid: list[bool]
    bt: np.ndarray  # sanitized block table

    def tokens(self, s: int) -> range:
        return range(self.cu[s], self.cu[s + 1])


def expected(x: dict, bs: int) -> Expected:
    cu_in = [int(v) for v in x["cumulative_sequence_length"]]
    past_in = [int(v) for v in x["past_seqlens"]]
    nseq, t = len(past_in), x["query"].shape[0]
    num_blocks, max_blocks = x["key_cache"].shape[0], x["block_table"].shape[1]
    cu = [0] + [min(t, max(0, v)) for v in cu_in[1:-1]] + [t]
    for i in range(1, nseq + 1):
        cu[i] = max(cu[i], cu[i - 1])
    past, valid = [], []
    for s in range(nseq):
        q = cu[s + 1] - cu[s]
        ok = 0 <= past_in[s] <= max(max_blocks * bs - q, 0)
        past.append(past_in[s] if ok else 0)
        valid.append(ok)
    bt = np.array(
        [[v if -1 <= v < num_blocks else -1 for v in row] for row in x["block_table"].tolist()], np.int64
    ).reshape(nseq, max_blocks)
    return Expected(cu, past, valid, bt)


def writable_slots(x: dict, e: Expected, bs: int) -> set[int]:
    """Slots the sanitized batch lets valid sequences write (reference §3.4(c), §3.5)."""
    total = x["key_cache"].shape[0] * bs
    out: set[int] = set()
    for s in range(len(e.past)):
        if not e.valid[s]:
            continue
        for i, tok in enumerate(e.tokens(s)):
            if "slot_mapping" in x:
                slot = int(x["slot_mapping"][tok])
            else:
                p = e.past[s] + i
                page = int(e.bt[s, p // bs]) if p // bs < e.bt.shape[1] else -1
                slot = page * bs + p % bs if page >= 0 else -1
            if 0 <= slot < total:
                out.add(slot)
    return out


def changed_slots(before: np.ndarray, after: np.ndarray) -> set[int]:
    a = before.reshape(before.shape[0] * before.shape[1], -1).view(np.uint16)
    b = after.reshape(a.shape[0], -1).view(np.uint16)
    return set(np.nonzero((a != b).any(axis=1))[0].tolist())


def assert_cache_equal(got: np.ndarray, exp: np.ndarray, what: str) -> None:
    """Byte-identical, except that NaN equals NaN whatever its payload or sign bit."""
    g, e = got.view(np.uint16), exp.view(np.uint16)
    both_nan = np.isnan(got.astype(np.float32)) & np.isnan(exp.astype(np.float32))
    bad = (g != e) & ~both_nan
    assert not bad.any(), f"{what}: {int(bad.sum())} cache elements differ, first at {np.argwhere(bad)[0].tolist()}"


def affected(clean: Batch, e: Expected) -> set[int]:
    """Corrupted sequences plus those whose token range the corrupted offsets moved."""
    cu = clean.clean_cu
    moved = {s for s in range(len(clean.q_lens)) if (e.cu[s], e.cu[s + 1]) != (int(cu[s]), int(cu[s + 1]))}
    return moved | set(clean.kinds)


# ------------------------------------------------------------------------------------------------ the check
def check_malformed(clean: Batch, bad: Batch) -> None:
    x, bs = bad.inputs, bad.block_size
    nseq = len(bad.q_lens)
    e = expected(x, bs)
    hit = affected(bad, e)
    ref = {"oracle": run_oracle(clean, clean.inputs), "portable": run_portable(clean, clean.inputs)}
    got = {"oracle": run_oracle(bad, x), "portable": run_portable(bad, x)}  # (1) neither raises
    cache_names = [n for n in ("key_cache_out", "value_cache_out") if n in got["oracle"]]

    # (2) oracle == portable
    o, p = got["oracle"]["output"], got["portable"]["output"]
    nan_o, nan_p = np.isnan(o.astype(np.float32)), np.isnan(p.astype(np.float32))
    assert (nan_o == nan_p).all(), f"NaN masks differ at rows {sorted(set(np.nonzero(nan_o != nan_p)[0].tolist()))}"
    assert_close(p, o, bad.sig.dtype, what="output (portable vs oracle)")
    for name in cache_names:
        assert_cache_equal(got["portable"][name], got["oracle"][name], f"{name} (portable vs oracle)")

    writable = writable_slots(x, e, bs)
    owned_by_hit = {blk for s in hit for blk in bad.owned_blocks[s]}
    tainted = nonfinite_readers(bad, e)
    for which, g in got.items():
        out = g["output"].astype(np.float32)
        for name in cache_names:
            src = x[name.removesuffix("_out")]
            # (3) writes only where a valid sequence may write
            stray = changed_slots(src, g[name]) - writable
            assert not stray, f"{which} {name}: writes outside writable slots: {sorted(stray)[:8]}"
            # (4) blocks of untouched sequences and unowned blocks: as in the clean run
            for blk in range(src.shape[0]):
                if blk not in owned_by_hit:
                    assert_cache_equal(g[name][blk], ref[which][name][blk], f"{which} {name} block {blk}")
        for s in range(nseq):
            rows = list(e.tokens(s))
            if not e.valid[s]:
                assert not out[rows].any(), f"{which}: invalid sequence {s} has a non-zero output"
            if s not in hit and which == "oracle":  # the oracle computes each sequence alone: bit for bit
                np.testing.assert_array_equal(
                    g["output"][rows].view(np.uint16),
                    ref[which]["output"][rows].view(np.uint16),
                    err_msg=f"{which}: untouched sequence {s} output differs from the clean run",
                )
            elif s not in hit:
                # the portable op pads every sequence to the call's longest query and key range, so corrupting
                # another sequence changes the padded shapes and ONNX Runtime's MatMul blocking: last-ulp
                # differences (seen: 1 ulp in fp16, LATENT), not leaks, which would be NaN or O(1)
                assert_close(
                    g["output"][rows],
                    ref[which]["output"][rows],
                    bad.sig.dtype,
                    what=f"{which}: untouched sequence {s} output differs from the clean run",
                )
            # (5) non-finite values stay with the sequence that owns or reads them
            if s not in tainted:
                assert np.isfinite(out[rows]).all(), f"{which}: sequence {s} output is not finite ({bad.kinds})"


def nonfinite_readers(b: Batch, e: Expected) -> set[int]:
    """Sequences that own a non-finite query/key/value row or whose block table reaches a non-finite cache slot
    (written in this call, or garbage already there)."""
    x, bs = b.inputs, b.block_size
    bad_tok = np.zeros(x["query"].shape[0], bool)
    for name in ("query", "key", "value"):
        if name in x:
            bad_tok |= ~np.isfinite(x[name].astype(np.float32)).all(axis=1)
    out = {s for s in range(len(e.past)) if bad_tok[list(e.tokens(s))].any()}
    slots_bad = set()
    for name in ("key_cache", "value_cache"):
        if name in x:
            c = x[name].astype(np.float32).reshape(x[name].shape[0] * bs, -1)
            slots_bad |= set(np.nonzero(~np.isfinite(c).all(axis=1))[0].tolist())
    if "slot_mapping" in x:
        slots_bad |= {int(x["slot_mapping"][t]) for t in np.nonzero(bad_tok)[0]}
    for s in range(len(e.past)):
        kvlen = min(e.past[s] + len(e.tokens(s)), e.bt.shape[1] * bs) if e.valid[s] else 0
        for j in range(kvlen):
            page = int(e.bt[s, j // bs])
            if page >= 0 and page * bs + j % bs in slots_bad:
                out.add(s)
    return out


# ------------------------------------------------------------------------------------------------ tests
@st.composite
def cases(draw, dtype, layout: str, **sizes) -> tuple[Batch, Batch]:
    sig = Sig(dtype, layout, slots=draw(st.booleans()), rotary=draw(st.booleans()))
    clean = draw(clean_batches(sig, **sizes))
    return clean, draw(corrupt(clean))


@pytest.mark.parametrize("layout", GENERATED_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@given(data=st.data())
def test_malformed_inputs(dtype, layout: str, data) -> None:
    clean, bad = data.draw(cases(dtype, layout))
    check_malformed(clean, bad)


@pytest.mark.slow
@pytest.mark.parametrize("layout", GENERATED_LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@settings(max_examples=int(os.environ.get("ORTPA_MALFORMED_EXAMPLES", "2000")))
@given(data=st.data())
def test_malformed_inputs_long(dtype, layout: str, data) -> None:
    """Larger batches, longer sequences and pasts; budget from ORTPA_MALFORMED_EXAMPLES (default 2000)."""
    clean, bad = data.draw(cases(dtype, layout, max_batch=8, max_q=20, max_past=100))
    check_malformed(clean, bad)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_duplicate_slots_last_writer_wins(dtype) -> None:
    """Many tokens on few slots: each slot ends up with the bytes of its last (highest-index) writer.

    Without the op's de-duplication ONNX Runtime's parallel ScatterND leaves an earlier writer's bytes in some
    slots (measured: 8 of 160 slots over 20 runs of 2048 writes of 1024 elements).
    """
    rng = np.random.default_rng(31)
    sig = Sig(dtype, "WIDE", slots=True, rotary=False)
    d = LAYOUTS["WIDE"]
    t, kvh, h, bs = 2048, d["kv_num_heads"], d["head_size"], 16
    x = {
        "query": rng.standard_normal((t, d["num_heads"] * h)).astype(dtype),
        "key": rng.standard_normal((t, kvh * h)).astype(dtype),
        "value": rng.standard_normal((t, kvh * h)).astype(dtype),
        "key_cache": rng.standard_normal((4, bs, kvh, h)).astype(dtype),
        "value_cache": rng.standard_normal((4, bs, kvh, h)).astype(dtype),
        # one sequence per token: short rows keep the attention small while the write set stays large
        "cumulative_sequence_length": np.arange(t + 1, dtype=np.int32),
        "past_seqlens": np.zeros(t, np.int32),
        "block_table": np.tile(np.array([[1]], np.int32), (t, 1)),
    }
    x["slot_mapping"] = rng.integers(0, 4 * bs, t).astype(np.int32)
    b = Batch(sig, x, [1] * t, [0] * t, [[1]] * t, bs)
    runs = [("oracle", run_oracle(b, x))] + [("portable", run_portable(b, x)) for _ in range(3)]
    for which, got in runs:
        for name, new in (("key_cache_out", x["key"]), ("value_cache_out", x["value"])):
            flat = got[name].reshape(4 * bs, -1)
            for slot in range(4 * bs):
                writers = np.nonzero(x["slot_mapping"] == slot)[0]
                exp = new[writers[-1]] if writers.size else x[name.removesuffix("_out")].reshape(4 * bs, -1)[slot]
                np.testing.assert_array_equal(flat[slot].view(np.uint16), exp.view(np.uint16), f"{which} {name} {slot}")
