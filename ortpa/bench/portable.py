"""Decode step of the portable PagedAttention on ONNX Runtime CPU.

Rows (``run(quick)`` returns them; ``ortpa bench --only portable`` or ``python -m ortpa.bench.portable [--quick]``
prints a table):

* ``decode_ms/portable/bB/ctxN`` and ``decode_ms/ort_gqa/bB/ctxN``: one new token for each of B sequences at
  context N (B 1 / 4 / 16, N 256-8192), GQA 32 query / 8 KV heads of 128, float16. The portable op binds its
  caches aliased (in place); ONNX Runtime's own CPU attention (``com.microsoft::GroupQueryAttention``) binds
  past and present KV to one shared buffer, its fastest decode mode. ``ratio/bB/ctxN`` = portable / GQA
  (target: <= 1.5 at batch 4, context 2048), with ``os.cpu_count()`` intra-op threads set explicitly (reported,
  with ONNX Runtime's version, in the notes), the two timed interleaved.
* ``ratio_1thread/bB/ctxN``: the same steps with one ONNX Runtime thread each, timed interleaved in CPU time of
  this process: on a shared machine the multi-threaded wall-clock ratio swings with the neighbours' load.
* ``linearity``: time per 1k context tokens at 8192 over the same at 2048, batch 1 (1.0 = linear).
* ``pool_ratio``: the portable step with 4096 allocated blocks over 64 blocks at the same context (target ~1:
  the aliased ScatterND never copies the pool), and the unaliased 4096-block step for contrast.
* ``if_free_ratio/<step>``: the If-free form over the default form (see :func:`if_free_rows`).
* ``mixed_ms`` / ``mixed_ratio``: one step holding a 256-token prompt chunk (its context ending at 2048) and 15
  decodes at context 2048, against the same work run as one prefill step plus one decode step (target: the
  mixed step <= 1.3x the sum). The three steps are timed interleaved, so load from other processes hits them
  alike.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from ortpa.bench import format_table
from ortpa.bench._timing import aliased_step, interleaved_ms, median_ms
from ortpa.bench._timing import row as _row
from ortpa.ops.portable import lower_to_portable, paged_attention_model, portable_single_node_model
from ortpa.providers import CPU

__all__ = ["if_free_rows", "run"]

N, KVH, H, BS = 32, 8, 128, 16


def _session(model, threads: int = 0) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    if threads:
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=[CPU])


def _paged_inputs(batch: int, ctx: int, num_blocks: int, rng) -> dict:
    per_seq = -(-(ctx + 1) // BS)
    if batch * per_seq > num_blocks:
        raise ValueError(f"pool: expected at least {batch * per_seq} blocks, found {num_blocks}")
    blocks = rng.permutation(num_blocks)[: batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    return {
        "query": rng.standard_normal((batch, N * H)).astype(np.float16),
        "key": rng.standard_normal((batch, KVH * H)).astype(np.float16),
        "value": rng.standard_normal((batch, KVH * H)).astype(np.float16),
        "key_cache": rng.standard_normal((num_blocks, BS, KVH, H)).astype(np.float16),
        "value_cache": rng.standard_normal((num_blocks, BS, KVH, H)).astype(np.float16),
        "cumulative_sequence_length": np.arange(batch + 1, dtype=np.int32),
        "past_seqlens": np.full(batch, ctx, np.int32),
        "block_table": blocks,
    }


def _mixed_inputs(decodes: int, ctx: int, chunk: int, rng) -> dict[str, dict]:
    """Index inputs for ``mixed`` (chunk + decodes), ``prefill`` (the chunk alone) and ``decode`` (the decodes).

    One pool; the chunk's sequence and every decoding sequence own disjoint blocks, so the three steps do the
    same work (the chunk's context ends at ``ctx``; each decode attends to ``ctx + 1`` keys).
    """
    per_seq = -(-(ctx + 1) // BS)
    batch = decodes + 1
    blocks = rng.permutation(batch * per_seq + 8)[: batch * per_seq].reshape(batch, per_seq).astype(np.int32)
    caches = {
        name: rng.standard_normal((batch * per_seq + 8, BS, KVH, H)).astype(np.float16)
        for name in ("key_cache", "value_cache")
    }
    q_lens = np.array([chunk] + [1] * decodes, np.int32)
    past = np.array([ctx - chunk] + [ctx] * decodes, np.int32)

    def step(sel: slice) -> dict:
        t = int(q_lens[sel].sum())
        return {
            "query": rng.standard_normal((t, N * H)).astype(np.float16),
            "key": rng.standard_normal((t, KVH * H)).astype(np.float16),
            "value": rng.standard_normal((t, KVH * H)).astype(np.float16),
            **caches,
            "cumulative_sequence_length": np.concatenate([[0], np.cumsum(q_lens[sel])]).astype(np.int32),
            "past_seqlens": past[sel].copy(),
            "block_table": blocks[sel].copy(),
        }

    return {"mixed": step(slice(0, batch)), "prefill": step(slice(0, 1)), "decode": step(slice(1, batch))}


def _gqa_model():
    f16 = TensorProto.FLOAT16

    def vi(name, shape, dt=f16):
        return helper.make_tensor_value_info(name, dt, shape)

    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length"]
    node = helper.make_node(
        "GroupQueryAttention",
        names,
        ["output", "present_key", "present_value"],
        domain="com.microsoft",
        num_heads=N,
        kv_num_heads=KVH,
    )
    kv = ["B", KVH, "P", H]
    graph = helper.make_graph(
        [node],
        "gqa",
        [vi("query", ["B", 1, N * H]), vi("key", ["B", 1, KVH * H]), vi("value", ["B", 1, KVH * H]),
         vi("past_key", kv), vi("past_value", kv), vi("seqlens_k", ["B"], TensorProto.INT32),
         vi("total_sequence_length", [], TensorProto.INT32)],
        [vi("output", ["B", 1, N * H]), vi("present_key", kv), vi("present_value", kv)],
    )  # fmt: skip
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)], ir_version=10
    )


def _gqa_step(sess: ort.InferenceSession, batch: int, ctx: int, rng):
    cap = ctx + 64  # shared past/present buffer with room to grow, as genai binds it
    pk = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((batch, KVH, cap, H)).astype(np.float16))
    pv = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((batch, KVH, cap, H)).astype(np.float16))
    io = sess.io_binding()
    io.bind_cpu_input("query", rng.standard_normal((batch, 1, N * H)).astype(np.float16))
    io.bind_cpu_input("key", rng.standard_normal((batch, 1, KVH * H)).astype(np.float16))
    io.bind_cpu_input("value", rng.standard_normal((batch, 1, KVH * H)).astype(np.float16))
    io.bind_ortvalue_input("past_key", pk)
    io.bind_ortvalue_input("past_value", pv)
    io.bind_cpu_input("seqlens_k", np.full(batch, ctx, np.int32))
    io.bind_cpu_input("total_sequence_length", np.array(ctx + 1, np.int32))
    io.bind_output("output")
    io.bind_ortvalue_output("present_key", pk)
    io.bind_ortvalue_output("present_value", pv)
    return lambda: sess.run_with_iobinding(io)


def _shapes(quick: bool) -> list[tuple[int, int]]:
    """(batch, context) of the decode comparison: batch 4 at 2048 is the target; 16 stops at 2048 (its
    gathered float32 K/V at 8192 would be ~2 GB on a shared machine)."""
    if quick:
        return [(1, 256), (1, 2048), (4, 256), (4, 2048), (16, 256)]
    return [(b, c) for b in (1, 4) for c in (256, 512, 2048, 8192)] + [(16, 256), (16, 2048)]


def run(quick: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    repeats = 5 if quick else 15
    attrs = {"num_heads": N, "kv_num_heads": KVH}
    threads = os.cpu_count() or 1
    env = f"ORT {ort.__version__} CPU, {threads} intra-op threads (1 inter-op), median of {repeats} interleaved"
    rows: list[dict] = []
    sessions = {
        (kind, t): _session(portable_single_node_model(_paged_inputs(1, 16, 8, rng), attrs) if kind == "portable"
                            else _gqa_model(), t)
        for kind in ("portable", "gqa") for t in (threads, 1)
    }  # fmt: skip
    per_k: dict[int, float] = {}
    for batch, ctx in _shapes(quick):
        blocks = batch * (-(-(ctx + 1) // BS)) + 8
        x = _paged_inputs(batch, ctx, blocks, rng)
        shape = f"batch {batch}, context {ctx}, GQA {N}/{KVH}x{H}, fp16, block {BS}"
        tag = f"b{batch}/ctx{ctx}"
        # wall time at the machine's threads, then CPU time at one thread; portable and GQA interleaved in each
        for t, clock, suffix in ((threads, time.perf_counter, ""), (1, time.process_time, "_1thread")):
            fns = {"portable": aliased_step(sessions["portable", t], x, alias=True)}
            fns["gqa"] = _gqa_step(sessions["gqa", t], batch, ctx, rng)
            ms = interleaved_ms(fns, repeats, clock)
            what = f"{shape}; {env}" if t == threads else f"{shape}; 1 ORT thread, CPU time of this process"
            if not suffix:
                rows.append(_row(f"decode_ms/portable/{tag}", "step_time", ms["portable"], "ms", what + "; aliased"))
                rows.append(_row(f"decode_ms/ort_gqa/{tag}", "step_time", ms["gqa"], "ms", "shared past/present"))
                if batch == 1:
                    per_k[ctx] = ms["portable"] / (ctx / 1024)
            target = "; target <= 1.5" if (batch, ctx) == (4, 2048) else ""
            note = f"portable {ms['portable']:.2f} ms, GQA {ms['gqa']:.2f} ms{target}"
            rows.append(_row(f"ratio{suffix}/{tag}", "portable_over_gqa", ms["portable"] / ms["gqa"], "x",
                             (what + "; " if suffix else "") + note))  # fmt: skip
    if 8192 in per_k and 2048 in per_k:
        rows.append(_row("linearity/8192_vs_2048", "ms_per_1k_ratio", per_k[8192] / per_k[2048], "x", "1.0 = linear"))
    portable = sessions["portable", threads]

    ctx = 512
    big_x = _paged_inputs(1, ctx, 4096, rng)
    pool = {"small": aliased_step(portable, _paged_inputs(1, ctx, 64, rng), alias=True)}
    pool["big"] = aliased_step(portable, big_x, alias=True)
    pool_ms = interleaved_ms(pool, repeats)
    small, big = pool_ms["small"], pool_ms["big"]
    big_copy = median_ms(aliased_step(portable, big_x, alias=False), max(3, repeats // 4))
    note = f"ctx {ctx}, same step, 64 vs 4096 blocks of {BS}"
    rows.append(_row("pool/64_blocks", "step_time", small, "ms", note + ", aliased"))
    rows.append(_row("pool/4096_blocks", "step_time", big, "ms", note + ", aliased"))
    rows.append(_row("pool/4096_blocks_unaliased", "step_time", big_copy, "ms", "fresh cache outputs (full copy)"))
    rows.append(_row("pool_ratio/4096_vs_64", "step_time_ratio", big / small, "x", "target ~1 (in-place write)"))

    ctx, chunk, decodes = 2048, 256, 15
    steps = _mixed_inputs(decodes, ctx, chunk, rng)
    ms = interleaved_ms({k: aliased_step(portable, x, alias=True) for k, x in steps.items()}, repeats)
    shape = f"GQA {N}/{KVH}x{H}, fp16, block {BS}"
    rows.append(_row("mixed_ms/mixed", "step_time", ms["mixed"], "ms", f"{chunk}-token chunk + {decodes} decodes "
                     f"at context {ctx}, one step; {shape}"))  # fmt: skip
    rows.append(_row("mixed_ms/prefill", "step_time", ms["prefill"], "ms", f"the {chunk}-token chunk alone"))
    rows.append(_row("mixed_ms/decode", "step_time", ms["decode"], "ms", f"the {decodes} decodes alone"))
    ratio = ms["mixed"] / (ms["prefill"] + ms["decode"])
    rows.append(_row("mixed_ratio/mixed_vs_separate", "step_time_ratio", ratio, "x", "mixed over prefill + decode; "
                     "target <= 1.3"))  # fmt: skip
    rows += if_free_rows(rng, repeats)
    return rows


def if_free_rows(rng: np.random.Generator, repeats: int) -> list[dict]:
    """``if_free_ratio/<step>``: the If-free form (``convert --portable --if-free``) over the default form, one ORT
    thread each, CPU time, interleaved: a decode-only step (its dummy prefill member runs too, and the decodes take
    the standard ops instead of MultiHeadAttention), a 256-token prompt chunk alone (its dummy decode runs too),
    and both in one step."""
    attrs = {"num_heads": N, "kv_num_heads": KVH}
    ctx, chunk, decodes = 1024, 256, 4
    steps = _mixed_inputs(decodes, ctx, chunk, rng)
    probe = _paged_inputs(1, 16, 8, rng)
    forms = {
        "default": lower_to_portable(paged_attention_model(probe, attrs)),
        "if_free": lower_to_portable(paged_attention_model(probe, attrs), if_free=True),
    }
    sessions = {form: _session(model, 1) for form, model in forms.items()}
    rows = []
    for step, x in (("decode", steps["decode"]), ("prefill", steps["prefill"]), ("mixed", steps["mixed"])):
        fns = {form: aliased_step(sess, x, alias=True) for form, sess in sessions.items()}
        ms = interleaved_ms(fns, repeats, time.process_time)
        what = {"decode": f"{decodes} decodes", "prefill": f"a {chunk}-token chunk", "mixed": "both"}[step]
        note = (f"{what} at context {ctx}, GQA {N}/{KVH}x{H} fp16, 1 ORT thread, CPU time; if-free "
                f"{ms['if_free']:.2f} ms, default {ms['default']:.2f} ms")  # fmt: skip
        rows.append(_row(f"if_free_ratio/{step}", "step_time_ratio", ms["if_free"] / ms["default"], "x", note))
    return rows


if __name__ == "__main__":
    print(format_table(run(quick="--quick" in sys.argv[1:])))
