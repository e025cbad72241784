"""The portable PagedAttention (standard ONNX ops on ONNX Runtime CPU) against the NumPy oracle.

Outputs are compared with the suite's tolerances, caches bit for bit (QK-norm: within one T rounding, since
the float32 mean may sum in another order). Sessions are cached per model within the module.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from support.iobind import bind_cpu
from support.tolerances import assert_close

from ortpa.errors import InvalidArgument, NotImplementedByBackend
from ortpa.ops.oracle import paged_attention
from ortpa.ops.portable import (
    FUNCTION_DOMAIN,
    lower_to_portable,
    paged_attention_model,
    portable_single_node_model,
)
from ortpa.ops.spec import PAGED_ATTENTION

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16]
_SESSIONS: dict[bytes, ort.InferenceSession] = {}


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    key = model.SerializeToString()
    if key not in _SESSIONS:
        so = ort.SessionOptions()
        so.intra_op_num_threads = 2
        _SESSIONS[key] = ort.InferenceSession(key, so, providers=["CPUExecutionProvider"])
    return _SESSIONS[key]


def run(sess: ort.InferenceSession, inputs: dict, *, alias: bool = False) -> dict[str, np.ndarray]:
    """Run through IO binding (bfloat16 has no numpy path in ONNX Runtime); outputs are preallocated.

    ``alias=False`` binds fresh cache outputs (inputs stay untouched); ``alias=True`` binds each cache input's
    own buffer as its output, as the runtime does.
    """
    io = sess.io_binding()
    keep = []
    for name, a in inputs.items():
        if a is None or name.startswith("_"):
            continue
        a = np.ascontiguousarray(a)
        keep.append(a)
        bind_cpu(io, name, a)
    outs: dict[str, np.ndarray] = {}
    for o in sess.get_outputs():
        if o.name == "output":
            width = inputs["_width"]
            arr = np.zeros((inputs["query"].shape[0], width), inputs["query"].dtype)
        else:
            src = inputs["key_cache" if o.name == "key_cache_out" else "value_cache"]
            arr = src if alias else np.empty_like(src)
        outs[o.name] = arr
        bind_cpu(io, o.name, arr, output=True)
    sess.run_with_iobinding(io)
    return outs


# ------------------------------------------------------------------------------------------------ cases
@dataclass
class Case:
    inputs: dict
    attrs: dict
    dtype: np.dtype
    exact_cache: bool = True
    quant_step: dict = field(default_factory=dict)


def make_case(
    rng: np.random.Generator,
    dtype,
    *,
    q_lens=(3, 1, 5),
    pasts=(0, 17, 33),
    num_heads=4,
    kv_num_heads=2,
    head_size=32,
    block_size=16,
    spare_blocks=3,
    packed=False,
    latent=False,
    v_head_size=0,
    rotary=None,  # (rotary_dim, interleaved, offset)
    qk_norm=False,
    head_sink=False,
    slot_mapping=None,
    quant=None,  # (cache dtype "int8", k_quant, v_quant)
    cache_outputs=True,
    **attrs,
) -> Case:
    dtype = np.dtype(dtype)
    n, kvh, h = num_heads, kv_num_heads, head_size
    t = int(sum(q_lens))
    kvlens = [p + q for p, q in zip(pasts, q_lens, strict=True)]
    need = [max(1, -(-L // block_size)) for L in kvlens]
    max_blocks = max(need) + 1  # at least one -1 tail entry per sequence
    num_blocks = sum(need) + spare_blocks
    perm = rng.permutation(num_blocks)
    bt = np.full((len(q_lens), max_blocks), -1, np.int32)
    at = 0
    for b, k in enumerate(need):
        bt[b, :k] = perm[at : at + k]
        at += k

    def act(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(dtype)

    a = {"num_heads": n, "kv_num_heads": kvh, **attrs}
    x: dict = {}
    if latent:
        a["kv_cache_layout"] = "LATENT"
        if v_head_size:
            a["v_head_size"] = v_head_size
            a.setdefault("scale", float(1.0 / np.sqrt(h)) * 1.3)
        x["query"], x["key"] = act(t, n * h), act(t, h)
    elif packed:
        x["query"] = act(t, (n + 2 * kvh) * h)
    else:
        x["query"], x["key"], x["value"] = act(t, n * h), act(t, kvh * h), act(t, kvh * h)
    cache_shape = (num_blocks, block_size, kvh, h)
    k_scale = v_scale = None
    quant_step = {}
    if quant is None:
        x["key_cache"] = act(*cache_shape)
        if not latent:
            x["value_cache"] = act(*cache_shape)
    else:
        _, kq, vq = quant
        a["k_quant_type"] = kq
        x["key_cache"] = rng.integers(-127, 128, cache_shape, dtype=np.int8)

        def scale(q):
            if q == "PER_TENSOR":
                return np.array([4.0 / 127], np.float32)
            return rng.uniform(2.0, 5.0, (kvh, 1, h)).astype(np.float32) / 127

        k_scale = scale(kq)
        quant_step["key_cache_out"] = float(k_scale.max())
        if not latent:
            a["v_quant_type"] = vq
            x["value_cache"] = rng.integers(-127, 128, cache_shape, dtype=np.int8)
            v_scale = scale(vq)
            quant_step["value_cache_out"] = float(v_scale.max())
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    x["cumulative_sequence_length"] = cu
    x["past_seqlens"] = np.array(pasts, np.int32)
    x["block_table"] = bt
    if rotary is not None:
        rd, inter, off = rotary
        rows = max(kvlens) + 4
        ang = rng.uniform(0, 2 * np.pi, (rows, rd // 2))
        x["cos_cache"], x["sin_cache"] = np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)
        a.update(do_rotary=1, rotary_interleaved=int(inter))
        if off:
            a["rotary_offset"] = off
    if slot_mapping is not None:
        x["slot_mapping"] = np.asarray(slot_mapping, np.int32)
    if head_sink:
        x["head_sink"] = act(n, s=2.0)
    if qk_norm:
        x["q_norm_weight"] = rng.uniform(0.5, 1.5, h).astype(dtype)
        x["k_norm_weight"] = rng.uniform(0.5, 1.5, h).astype(dtype)
    if k_scale is not None:
        x["k_scale"] = k_scale
    if v_scale is not None:
        x["v_scale"] = v_scale
    case = Case(x, a, dtype, exact_cache=not qk_norm, quant_step=quant_step)
    case.cache_outputs = cache_outputs  # type: ignore[attr-defined]
    return case


def check(case: Case, *, model: onnx.ModelProto | None = None) -> dict:
    """Run the portable model and the oracle; compare; return the portable outputs."""
    x, a = case.inputs, case.attrs
    full = {name: x.get(name) for name in PAGED_ATTENTION.input_names}
    exp_out, exp_k, exp_v = paged_attention(**full, **a)
    if model is None:
        model = portable_single_node_model(x, a, cache_outputs=getattr(case, "cache_outputs", True))
    feed = dict(x)
    feed["_width"] = exp_out.shape[1]
    got = run(session(model), {k: v for k, v in feed.items()})
    assert_close(got["output"], exp_out, case.dtype, what="output")
    for name, exp in (("key_cache_out", exp_k), ("value_cache_out", exp_v)):
        if name not in got:
            continue
        g = got[name]
        if name in case.quant_step:
            diff = np.abs(g.astype(np.int32) - exp.astype(np.int32))
            assert diff.max() <= 1, f"{name}: {int((diff > 1).sum())} elements off by more than one step"
        elif case.exact_cache:
            np.testing.assert_array_equal(g.view(np.uint16), exp.view(np.uint16), err_msg=name)
        else:
            assert_close(g, exp, case.dtype, what=name)
    return got


# ------------------------------------------------------------------------------------------------ matrix
MATRIX = {
    "mha": dict(num_heads=4, kv_num_heads=4),
    "gqa": dict(num_heads=8, kv_num_heads=2, head_size=64, pasts=(15, 16, 47), q_lens=(1, 1, 18)),
    "mqa_decode": dict(num_heads=4, kv_num_heads=1, q_lens=(1, 1, 1, 1), pasts=(0, 31, 32, 70)),
    # groups of three query heads (SmolLM's 9 over 3), decodes beside prompt chunks, RoPE in the op
    "gqa_group_of_three": dict(
        num_heads=9, kv_num_heads=3, head_size=64, q_lens=(1, 1, 18, 5), pasts=(15, 47, 0, 33), rotary=(64, False, 0)
    ),
    "mha_decode_64": dict(num_heads=4, kv_num_heads=4, head_size=64, q_lens=(1, 1, 1), pasts=(0, 31, 70)),
    "packed_qkv": dict(packed=True),
    "packed_rope": dict(packed=True, rotary=(32, False, 0)),
    "rope_half": dict(rotary=(32, False, 0), head_size=32),
    "rope_interleaved_partial_offset": dict(rotary=(16, True, 8), head_size=48),
    "rope_half_partial_offset": dict(rotary=(32, False, 16), head_size=64),
    "softcap": dict(softcap=2.5),
    "window": dict(local_window_size=5, q_lens=(9, 1, 4), pasts=(3, 40, 20)),
    "non_causal": dict(is_causal=0),
    "non_causal_window": dict(is_causal=0, local_window_size=7, q_lens=(6, 2, 5)),
    "head_sink": dict(head_sink=True, q_lens=(2, 1, 3)),
    "head_sink_window_softcap": dict(head_sink=True, local_window_size=3, softcap=5.0),
    "qk_norm_rope": dict(qk_norm=True, rotary=(32, False, 0)),
    "qk_norm": dict(qk_norm=True, qk_norm_epsilon=1e-5),
    "explicit_scale": dict(scale=0.3),
    "zero_length_sequence": dict(q_lens=(2, 0, 3, 0), pasts=(5, 9, 0, 16)),
    "block_32_long": dict(block_size=32, q_lens=(40, 1), pasts=(30, 95)),
    # decodes and prompt chunks interleaved (they attend in separate groups), empty sequences between them,
    # decodes with longer contexts than the chunks and chunks of different lengths
    "mixed_interleaved": dict(q_lens=(1, 7, 0, 1, 3, 1, 0), pasts=(60, 0, 5, 2, 33, 17, 0)),
    "mixed_gqa_rope_window": dict(
        num_heads=8,
        kv_num_heads=2,
        q_lens=(5, 1, 1, 12),
        pasts=(40, 3, 77, 0),
        rotary=(32, False, 0),
        local_window_size=9,
    ),
    "prefill_only_unequal": dict(q_lens=(5, 2, 9), pasts=(0, 30, 4)),
    "latent": dict(latent=True, num_heads=4, kv_num_heads=1, head_size=64, v_head_size=48, rotary=(16, False, 48)),
    "latent_equal_v": dict(latent=True, num_heads=2, kv_num_heads=1, head_size=32),
    "latent_noncausal_softcap": dict(
        latent=True, num_heads=4, kv_num_heads=1, head_size=64, v_head_size=32, is_causal=0, softcap=3.0
    ),
    "int8_per_tensor": dict(quant=("int8", "PER_TENSOR", "PER_TENSOR")),
    "int8_per_channel_mixed": dict(quant=("int8", "PER_CHANNEL", "PER_TENSOR"), rotary=(32, True, 0)),
    "int8_latent": dict(
        latent=True, num_heads=4, kv_num_heads=1, head_size=64, v_head_size=48, quant=("int8", "PER_CHANNEL", "")
    ),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(MATRIX))
def test_matrix(name: str, dtype) -> None:
    rng = np.random.default_rng(sum(map(ord, name)))
    check(make_case(rng, dtype, **MATRIX[name]))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_deepseek_like_latent(dtype) -> None:
    """576-wide latent rows, 512-wide values, RoPE on the last 64 channels, a few heads; prefill + decode."""
    rng = np.random.default_rng(576)
    check(
        make_case(
            rng,
            dtype,
            latent=True,
            num_heads=4,
            kv_num_heads=1,
            head_size=576,
            v_head_size=512,
            rotary=(64, False, 512),
            scale=float(192**-0.5),
            q_lens=(7, 1),
            pasts=(0, 40),
        )
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_slot_mapping_skips(dtype) -> None:
    """-1 and out-of-range slots skip the write; the token still attends (reference §3.5)."""
    rng = np.random.default_rng(7)
    case = make_case(rng, dtype, q_lens=(2, 3), pasts=(1, 4), spare_blocks=2)
    bt, bs = case.inputs["block_table"], 16
    slots = []
    for b, (p, q) in enumerate(((1, 2), (4, 3))):
        slots += [int(bt[b, (p + i) // bs]) * bs + (p + i) % bs for i in range(q)]
    slots[1] = -1
    slots[3] = 10**6  # beyond num_blocks * block_size
    case.inputs["slot_mapping"] = np.array(slots, np.int32)
    got = check(case)
    # the skipped tokens' slots hold the old cache bytes
    kc = case.inputs["key_cache"].reshape(-1, *case.inputs["key_cache"].shape[2:])
    gk = got["key_cache_out"].reshape(kc.shape)
    s1 = int(bt[0, 0]) * bs + 2
    np.testing.assert_array_equal(gk[s1].view(np.uint16), kc[s1].view(np.uint16))


# ------------------------------------------------------------------------------------------------ sanitization
MALFORMED = {
    "cu_negative_and_unsorted": dict(cumulative_sequence_length=[0, 5, -2, 6]),
    "cu_wrong_ends": dict(cumulative_sequence_length=[3, 2, 4, 99]),
    "past_negative": dict(past_seqlens=[-4, 17, 33]),
    "past_beyond_capacity": dict(past_seqlens=[0, 10**6, 33]),
    "block_table_out_of_range": dict(block_table_entry=(1, 0, 10**5)),
    "block_table_below_minus_one": dict(block_table_entry=(2, 1, -7)),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_inputs_sanitized(name: str, dtype) -> None:
    """Identical to the oracle; the cache changes only in slots of valid sequences' own mapped blocks."""
    rng = np.random.default_rng(11)
    case = make_case(rng, dtype, q_lens=(3, 1, 2), pasts=(0, 17, 33), spare_blocks=4, rotary=(32, False, 0))
    spec = MALFORMED[name]
    x = case.inputs
    if "block_table_entry" in spec:
        b, i, v = spec["block_table_entry"]
        x["block_table"] = x["block_table"].copy()
        x["block_table"][b, i] = v
    for key in ("cumulative_sequence_length", "past_seqlens"):
        if key in spec:
            x[key] = np.array(spec[key], np.int32)
    got = check(case)
    owned = {int(v) for v in x["block_table"].reshape(-1) if 0 <= v < x["key_cache"].shape[0]}
    for out, src in (("key_cache_out", "key_cache"), ("value_cache_out", "value_cache")):
        changed = np.nonzero((got[out].view(np.uint16) != x[src].view(np.uint16)).any(axis=(1, 2, 3)))[0]
        assert set(changed.tolist()) <= owned, f"{out}: writes outside mapped blocks: {sorted(changed)}"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.name)
def test_invalid_sequence_zero_output_others_unaffected(dtype) -> None:
    """An invalid past length zeroes that sequence and leaves the others' outputs and caches as without it."""
    rng = np.random.default_rng(5)
    case = make_case(rng, dtype, q_lens=(2, 3), pasts=(5, 9))
    good = check(case)
    case.inputs["past_seqlens"] = np.array([-1, 9], np.int32)
    bad = check(case)
    assert not bad["output"][:2].astype(np.float32).any()
    np.testing.assert_array_equal(bad["output"][2:].view(np.uint16), good["output"][2:].view(np.uint16))
    bt = case.inputs["block_table"]
    for blk in bt[1][bt[1] >= 0]:
        np.testing.assert_array_equal(
            bad["key_cache_out"][blk].view(np.uint16), good["key_cache_out"][blk].view(np.uint16)
        )
    for blk in bt[0][bt[0] >= 0]:
        np.testing.assert_array_equal(
            bad["key_cache_out"][blk].view(np.uint16), case.inputs["key_cache"][blk].view(np.uint16)
        )


@pytest.mark.parametrize("latent", [False, True], ids=["separate", "latent"])
@pytest.mark.parametrize("unmapped", [False, True], ids=["well_formed", "unmapped_page"])
def test_ragged_decodes_never_read_foreign_nan(latent: bool, unmapped: bool) -> None:
    """Decodes of different lengths pad to the longest; the padding, and an unmapped page inside a live range,
    read a row the decode attends (no zeroing pass). Either way NaN in blocks no sequence owns never reaches an
    output, and the outputs match the oracle."""
    rng = np.random.default_rng(11)
    kw = dict(latent=True, num_heads=4, kv_num_heads=1, head_size=64, v_head_size=48) if latent else {}
    case = make_case(rng, np.float16, q_lens=(1, 1, 1), pasts=(40, 3, 17), spare_blocks=4, **kw)
    x = case.inputs
    bt = x["block_table"]
    spare = sorted(set(range(x["key_cache"].shape[0])) - {int(b) for b in bt.reshape(-1)})[0]
    if (bt == 0).any():  # make block 0 (where an unmapped page's row lands) a foreign, NaN-filled block
        for name in ("key_cache", "value_cache"):
            if name in x:
                x[name][spare] = x[name][0]
        bt[bt == 0] = spare
    owned = {int(b) for b in bt.reshape(-1) if b >= 0}
    for name in ("key_cache", "value_cache"):
        if name in x:
            for blk in set(range(x[name].shape[0])) - owned:
                x[name][blk] = np.nan
    if unmapped:
        bt[0, 1] = -1  # inside sequence 0's live range (its past is 40, blocks of 16)
    got = check(case)
    assert np.isfinite(got["output"].astype(np.float32)).all()


@pytest.mark.parametrize("pasts", [(4, 0), (0, 0)], ids=["with_past", "nothing_to_attend"])
def test_zero_tokens(pasts) -> None:
    rng = np.random.default_rng(3)
    check(make_case(rng, np.float16, q_lens=(0, 0), pasts=pasts))


def test_cache_outputs_omitted() -> None:
    """Without cache outputs the call still attends to its own new tokens."""
    rng = np.random.default_rng(9)
    case = make_case(rng, np.float16, cache_outputs=False, q_lens=(4, 1), pasts=(0, 20))
    got = check(case)
    assert set(got) == {"output"}


def _matmul_elements(model: onnx.ModelProto, inputs: dict) -> int:
    """Output elements of every MatMul the call runs (scores and P @ V), read from ONNX Runtime's profile."""
    import json
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        so = ort.SessionOptions()
        so.enable_profiling = True
        so.profile_file_prefix = f"{tmp}/profile"
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        run(sess, inputs)
        with open(sess.end_profiling()) as f:
            events = json.load(f)
    total = 0
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "Node" and args.get("op_name") in ("MatMul", "FusedMatMul"):
            for out in args["output_type_shape"]:
                total += int(np.prod(next(iter(out.values()))))
        if e.get("cat") == "Node" and args.get("op_name") == "MultiHeadAttention":
            # the fused decode path: scores [D, kvh, G, kv] and output [D, G, kvh * vh], as the MatMuls would be
            q, k = (next(iter(x.values())) for x in args["input_type_shape"][:2])
            total += q[0] * q[1] * k[1] * k[2] + int(np.prod(next(iter(args["output_type_shape"][0].values()))))
    return total


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_mixed_step_work_follows_the_real_work(fused: bool) -> None:
    """A prompt chunk next to decodes costs about the chunk alone plus the decodes alone, not batch x chunk.

    Counted as MatMul output elements (no timing): padding every decode to the chunk's 64 query rows would
    make the mixed step ~6x its parts.
    """
    rng = np.random.default_rng(14)
    q_lens, pasts = (64, 1, 1, 1, 1, 1, 1), (36, 90, 92, 94, 96, 98, 99)
    case = make_case(rng, np.float16, q_lens=q_lens, pasts=pasts)
    model = lower_to_portable(paged_attention_model(case.inputs, case.attrs), fused=fused)
    check(case, model=model)  # exact as well as cheap
    width = {"_width": case.attrs["num_heads"] * 32}

    def part(sel: slice) -> dict:
        x = dict(case.inputs)
        lens = np.array(q_lens[sel])
        first, last = int(np.sum(q_lens[: sel.start])), int(np.sum(q_lens[: sel.stop]))
        for name in ("query", "key", "value"):
            x[name] = x[name][first:last]
        x["cumulative_sequence_length"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        x["past_seqlens"] = x["past_seqlens"][sel]
        x["block_table"] = x["block_table"][sel]
        return {**x, **width}

    mixed = _matmul_elements(model, {**case.inputs, **width})
    prefill = _matmul_elements(model, part(slice(0, 1)))
    decode = _matmul_elements(model, part(slice(1, len(q_lens))))
    assert prefill > 0 and decode > 0
    assert mixed <= 1.05 * (prefill + decode), f"mixed step {mixed} elements vs {prefill} + {decode} apart"


# ------------------------------------------------------------------------------------------------ in place
def _decode_inputs(num_blocks: int, rng) -> dict:
    n, kvh, h, bs = 8, 4, 64, 16
    ctx = 200
    used = -(-(ctx + 1) // bs)
    x = {
        "query": rng.standard_normal((1, n * h)).astype(np.float16),
        "key": rng.standard_normal((1, kvh * h)).astype(np.float16),
        "value": rng.standard_normal((1, kvh * h)).astype(np.float16),
        "key_cache": np.zeros((num_blocks, bs, kvh, h), np.float16),
        "value_cache": np.zeros((num_blocks, bs, kvh, h), np.float16),
        "cumulative_sequence_length": np.array([0, 1], np.int32),
        "past_seqlens": np.array([ctx], np.int32),
        "block_table": np.arange(used, dtype=np.int32)[None, :],
    }
    return x


def test_io_binding_aliased_cache_is_updated_in_place() -> None:
    rng = np.random.default_rng(1)
    attrs = {"num_heads": 8, "kv_num_heads": 4}
    x = _decode_inputs(64, rng)
    sess = session(portable_single_node_model(x, attrs))
    kc = x["key_cache"]
    ko = ort.OrtValue.ortvalue_from_numpy(kc)
    vo = ort.OrtValue.ortvalue_from_numpy(x["value_cache"])
    io = sess.io_binding()
    for name in ("query", "key", "value", "cumulative_sequence_length", "past_seqlens", "block_table"):
        io.bind_cpu_input(name, x[name])
    io.bind_ortvalue_input("key_cache", ko)
    io.bind_ortvalue_input("value_cache", vo)
    io.bind_output("output")
    io.bind_ortvalue_output("key_cache_out", ko)
    io.bind_ortvalue_output("value_cache_out", vo)
    ptr = ko.data_ptr()
    sess.run_with_iobinding(io)
    outs = io.get_outputs()
    assert ko.data_ptr() == ptr == outs[1].data_ptr()
    # position 200 -> block 12, offset 8; the numpy array behind the OrtValue holds the new key
    np.testing.assert_array_equal(kc[12, 8].reshape(-1), x["key"].reshape(-1))
    exp_out, exp_k, _ = paged_attention(**{**x, "key_cache": np.zeros_like(kc)}, **attrs)
    assert_close(outs[0].numpy(), exp_out, np.float16, what="output")
    np.testing.assert_array_equal(kc, exp_k)

    # plain run: fresh output arrays, inputs untouched
    y = _decode_inputs(64, rng)
    _, k_out, _ = sess.run(None, y)
    assert not y["key_cache"].any() and k_out[12, 8].any()


# ------------------------------------------------------------------------------------------------ lowering
def test_lowering_keeps_names_and_does_not_mutate() -> None:
    rng = np.random.default_rng(4)
    case = make_case(rng, np.float16, rotary=(32, False, 0))
    model = paged_attention_model(case.inputs, case.attrs)
    before = model.SerializeToString()
    lowered = lower_to_portable(model)
    assert model.SerializeToString() == before
    assert [i.name for i in lowered.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in lowered.graph.output] == [o.name for o in model.graph.output]
    # the step's plan (index work), then the layer
    assert [(n.domain, n.name) for n in lowered.graph.node] == [
        (FUNCTION_DOMAIN, "PagedAttention_0/plan"),
        (FUNCTION_DOMAIN, "PagedAttention_0"),
    ]

    # standard ops, but for the fused decode's one contrib kernel
    def nodes(graph_nodes):  # with the If branches' nodes
        for n in graph_nodes:
            yield n
            for attr in n.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    yield from nodes(attr.g.node)

    ops = {(n.domain, n.op_type) for f in lowered.functions for n in nodes(f.node)}
    assert {o for o in ops if o[0] not in ("", FUNCTION_DOMAIN)} == {("com.microsoft", "MultiHeadAttention")}
    # the cache outputs are ScatterND outputs whose data input is the cache graph input
    (f,) = [f for f in lowered.functions if f.name == lowered.graph.node[1].op_type]
    scatters = [n for n in f.node if n.op_type == "ScatterND"]
    assert {n.input[0] for n in scatters} == {"key_cache", "value_cache"}
    assert {n.output[0] for n in scatters} == set(f.output[1:])
    readers = [n for n in f.node if n.op_type != "ScatterND" and {"key_cache", "value_cache"} & set(n.input)]
    assert all(n.op_type == "Shape" for n in readers), [n.op_type for n in readers]


def test_node_selection_and_shared_function() -> None:
    rng = np.random.default_rng(6)
    case = make_case(rng, np.float16)
    m = paged_attention_model(case.inputs, case.attrs)
    node = m.graph.node[0]
    second = onnx.NodeProto()
    second.CopyFrom(node)
    second.name = "PagedAttention_1"
    del second.output[:]
    second.output.extend(["output_1", "key_cache_out_1", "value_cache_out_1"])
    m.graph.node.append(second)
    for name in second.output:
        m.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT16, None))
    only_second = lower_to_portable(m, ["PagedAttention_1"])
    assert [n.domain for n in only_second.graph.node] == ["com.microsoft", FUNCTION_DOMAIN, FUNCTION_DOMAIN]
    both = lower_to_portable(m)
    # identical configurations share one layer function, and the layers one plan call computed once per step
    assert len(both.functions) == 2
    assert [n.name for n in both.graph.node] == ["PagedAttention_0/plan", "PagedAttention_0", "PagedAttention_1"]
    plan_outputs = list(both.graph.node[0].output)
    assert all(list(n.input)[-len(plan_outputs) :] == plan_outputs for n in both.graph.node[1:])
    with pytest.raises(ValueError, match="unknown"):
        lower_to_portable(m, ["nope"])


def test_unsupported_and_invalid_nodes_raise_typed_errors() -> None:
    rng = np.random.default_rng(8)
    case = make_case(rng, np.float16)
    x = dict(case.inputs)
    fp8 = np.zeros(x["key_cache"].shape, ml_dtypes.float8_e4m3fn)
    x["key_cache"], x["value_cache"] = fp8, fp8
    x["k_scale"] = x["v_scale"] = np.ones(1, np.float32)
    attrs = {**case.attrs, "k_quant_type": "PER_TENSOR", "v_quant_type": "PER_TENSOR"}
    with pytest.raises(NotImplementedByBackend, match="float8e4m3fn"):
        lower_to_portable(paged_attention_model(x, attrs))
    with pytest.raises(InvalidArgument):
        lower_to_portable(paged_attention_model(case.inputs, {**case.attrs, "kv_num_heads": 3}))


@pytest.mark.parametrize("latent", [False, True], ids=["gqa", "latent"])
def test_branch_outputs_declare_type_and_rank(latent: bool) -> None:
    """Compilers such as OpenVINO refuse a value of unknown rank: every If output (the branches' and the If's) is
    declared with its element type and rank, and no Squeeze leaves its axes to be inferred."""
    kw = dict(latent=True, num_heads=4, kv_num_heads=1, head_size=64, v_head_size=48) if latent else {}
    case = make_case(np.random.default_rng(3), np.float16, q_lens=(1, 4), pasts=(9, 2), **kw)
    lowered = lower_to_portable(paged_attention_model(case.inputs, case.attrs))
    ifs = squeezes = 0
    for f in lowered.functions:
        nodes, declared, stack = [], {v.name: v for v in f.value_info}, list(f.node)
        while stack:  # every node, If branches included, and every declared value
            node = stack.pop()
            nodes.append(node)
            for g in (a.g for a in node.attribute if a.type == onnx.AttributeProto.GRAPH):
                declared.update({v.name: v for v in [*g.value_info, *g.output]})
                stack += g.node
        for node in nodes:
            squeezes += node.op_type == "Squeeze"
            assert node.op_type != "Squeeze" or len(node.input) == 2, node.name
            if node.op_type != "If":
                continue
            ifs += 1
            for k, out in enumerate(node.output):
                values = [a.g.output[k] for a in node.attribute] + [declared[out]]
                for v in values:
                    t = v.type.tensor_type
                    assert t.elem_type and t.HasField("shape"), f"{node.name}: {v.name} has no type or rank"
                assert len({len(v.type.tensor_type.shape.dim) for v in values}) == 1, (node.name, out)
    assert ifs >= 3 and squeezes >= 3  # the decode and prefill groups, the prefill plan; the plan's ranges
    check(case, model=lowered)
