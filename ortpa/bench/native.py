"""ortpa's native CPU PagedAttention kernel (``ortpa.ops.native``) against ONNX Runtime's own attention and the
portable lowering, one node on ONNX Runtime CPU.

Rows (``ortpa bench --only native`` or ``python -m ortpa.bench.native [--quick]``):

* ``decode_ms/{native,portable,ort_gqa}/b4/ctx2048``: one new token for each of 4 sequences at context 2048, GQA
  32 query / 8 KV heads of 128, float16, block 16, 2 intra-op threads. The native and portable sessions bind
  their caches aliased (in place); ``com.microsoft::GroupQueryAttention`` binds past and present KV to one shared
  buffer, its fastest decode mode. The three are timed interleaved, every session with its pool's spinning off
  (a pool spinning after its run would take a core from the next session's run).
* ``ratio/native_over_gqa`` (target <= 0.5) and ``ratio/native_over_portable``; ``ratio_1thread/...``: the same
  with one thread each in CPU time of this process (steadier on a shared machine).
* ``bandwidth/*``: the cache bytes the step reads (every K and V row of every context position) over the native
  step time, a NumPy copy of as many bytes measured in the same run, and their quotient ``bandwidth_share``
  (goal >= 0.3): decode attention is memory-bound, the kernel's job is to stream the pages at copy speed.
  ``bandwidth_1thread/*``: the same in CPU time with one thread (NumPy's copy is single-threaded).
* ``pool_ratio/4096_vs_64``: the native step with 4096 allocated blocks over 64 (target <= 1.15: the cache
  write is in place, the pool is never copied).
* ``mla_decode_ms/{native,portable}/ctx4096`` and ``mla_prefill_ms/...``: LATENT (absorbed MLA) at
  DeepSeek-V2-Lite's attention dims: 16 heads over one 576-wide latent row (512 + 64 RoPE channels, RoPE in the
  op), values the leading 512 channels, float16, one sequence: a decode at context 4096, a 1024-token prefill.
"""

from __future__ import annotations

import math
import sys
import time

import numpy as np
import onnxruntime as ort

from ortpa.bench import format_table
from ortpa.bench import portable as gqa_bench
from ortpa.bench._timing import aliased_step, interleaved_ms
from ortpa.bench._timing import row as _row
from ortpa.errors import OrtpaError
from ortpa.ops.native import absent_reason, native_library, register_native
from ortpa.ops.portable import paged_attention_model, portable_single_node_model
from ortpa.providers import CPU

__all__ = ["run"]

THREADS = 2
N, KVH, H, BS = gqa_bench.N, gqa_bench.KVH, gqa_bench.H, gqa_bench.BS
MLA_HEADS, MLA_LORA, MLA_ROPE, MLA_BLOCK = 16, 512, 64, 64


def _session(model, *, native: bool, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    # sessions are timed interleaved: a pool left spinning after its run would take a core from the next one
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if native:
        lib = native_library()
        if lib is None:
            raise OrtpaError(f"ortpa bench native: the native library is not available ({absent_reason()})")
        register_native(so, lib)
    return ort.InferenceSession(model.SerializeToString(), so, providers=[CPU])


def _pair(x: dict, attrs: dict, threads: int) -> dict[str, ort.InferenceSession]:
    return {
        "native": _session(paged_attention_model(x, attrs), native=True, threads=threads),
        "portable": _session(portable_single_node_model(x, attrs), native=False, threads=threads),
    }


def _copy_fn(nbytes: int):
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    return lambda: np.copyto(dst, src)


def _decode(rows: list[dict], repeats: int, rng) -> None:
    batch, ctx = 4, 2048
    attrs = {"num_heads": N, "kv_num_heads": KVH}
    x = gqa_bench._paged_inputs(batch, ctx, batch * (-(-(ctx + 1) // BS)) + 8, rng)
    cache_bytes = 2 * batch * (ctx + 1) * KVH * H * 2  # K and V rows the step reads, float16
    shape = f"batch {batch}, context {ctx}, GQA {N}/{KVH}x{H}, fp16, block {BS}"
    tag = f"b{batch}/ctx{ctx}"
    for threads, clock, suffix in ((THREADS, time.perf_counter, ""), (1, time.process_time, "_1thread")):
        sess = _pair(x, attrs, threads)
        fns = {k: aliased_step(s, {n: a.copy() for n, a in x.items()}, alias=True) for k, s in sess.items()}
        fns["gqa"] = gqa_bench._gqa_step(
            _session(gqa_bench._gqa_model(), native=False, threads=threads), batch, ctx, rng
        )
        fns["copy"] = _copy_fn(cache_bytes)
        ms = interleaved_ms(fns, repeats, clock)
        env = f"{threads} intra-op thread(s), ORT {ort.__version__}, " + ("wall" if not suffix else "CPU time")
        if not suffix:
            for k in ("native", "portable"):
                rows.append(_row(f"decode_ms/{k}/{tag}", "step_time", ms[k], "ms", f"{shape}; {env}; aliased"))
            rows.append(_row(f"decode_ms/ort_gqa/{tag}", "step_time", ms["gqa"], "ms", "shared past/present"))
        native_gbs = cache_bytes / ms["native"] / 1e6
        copy_gbs = cache_bytes / ms["copy"] / 1e6  # NumPy's copy runs on one thread
        rows.append(_row(f"bandwidth{suffix}/native", "cache_read_rate", native_gbs, "GB/s", f"{cache_bytes} B; {env}"))
        rows.append(_row(f"bandwidth{suffix}/numpy_copy", "copy_rate", copy_gbs, "GB/s", "same bytes, same run"))
        share = native_gbs / copy_gbs
        rows.append(_row(f"bandwidth_share{suffix}/native", "fraction_of_copy", share, "x", "goal >= 0.3"))
        note = f"native {ms['native']:.2f} ms, GQA {ms['gqa']:.2f} ms, portable {ms['portable']:.2f} ms; {env}"
        rows.append(_row(f"ratio{suffix}/native_over_gqa", "step_time_ratio", ms["native"] / ms["gqa"], "x",
                         note + ("; target <= 0.5" if not suffix else "")))  # fmt: skip
        rows.append(_row(f"ratio{suffix}/native_over_portable", "step_time_ratio", ms["native"] / ms["portable"],
                         "x", note))  # fmt: skip


def _pool(rows: list[dict], repeats: int, rng) -> None:
    ctx = 512
    attrs = {"num_heads": N, "kv_num_heads": KVH}
    small, big = (gqa_bench._paged_inputs(1, ctx, blocks, rng) for blocks in (64, 4096))
    sess = _session(paged_attention_model(small, attrs), native=True, threads=THREADS)
    ms = interleaved_ms({"small": aliased_step(sess, small), "big": aliased_step(sess, big)}, repeats)
    note = f"native, ctx {ctx}, batch 1, 64 vs 4096 blocks of {BS}, aliased; target <= 1.15"
    rows.append(_row("pool_ratio/4096_vs_64", "step_time_ratio", ms["big"] / ms["small"], "x", note))


def _mla_inputs(q_len: int, past: int, rng) -> tuple[dict, dict]:
    f16 = np.dtype(np.float16)  # the model's bfloat16 has no NumPy path in ONNX Runtime's IO binding
    h = MLA_LORA + MLA_ROPE
    kvlen = past + q_len
    max_blocks = -(-kvlen // MLA_BLOCK)
    num_blocks = max_blocks + 4
    half = MLA_ROPE // 2
    ang = np.arange(kvlen + 1)[:, None] / (10000.0 ** (np.arange(half) / half))[None, :]
    x = {
        "query": (rng.standard_normal((q_len, MLA_HEADS * h)) * 0.1).astype(f16),
        "key": (rng.standard_normal((q_len, h)) * 0.1).astype(f16),
        "key_cache": (rng.standard_normal((num_blocks, MLA_BLOCK, 1, h)) * 0.1).astype(f16),
        "cumulative_sequence_length": np.array([0, q_len], np.int32),
        "past_seqlens": np.array([past], np.int32),
        "block_table": rng.permutation(num_blocks)[:max_blocks].reshape(1, max_blocks).astype(np.int32),
        "cos_cache": np.cos(ang).astype(f16),
        "sin_cache": np.sin(ang).astype(f16),
    }
    attrs = {
        "num_heads": MLA_HEADS,
        "kv_num_heads": 1,
        "kv_cache_layout": "LATENT",
        "v_head_size": MLA_LORA,
        "scale": 1.0 / math.sqrt(128 + MLA_ROPE),  # V2-Lite: qk_nope 128 + qk_rope 64
        "do_rotary": 1,
        "rotary_interleaved": 1,
        "rotary_offset": MLA_LORA,
    }
    return x, attrs


def _mla(rows: list[dict], repeats: int, rng, quick: bool) -> None:
    shapes = {"mla_decode_ms": (1, 4095, "ctx4096"), "mla_prefill_ms": (256 if quick else 1024, 0, "")}
    for name, (q_len, past, tag) in shapes.items():
        x, attrs = _mla_inputs(q_len, past, rng)
        tag = tag or f"prefill{q_len}"
        sess = _pair(x, attrs, THREADS)
        fns = {k: aliased_step(s, {n: a.copy() for n, a in x.items()}, alias=True) for k, s in sess.items()}
        ms = interleaved_ms(fns, max(3, repeats // 2))
        what = (f"LATENT {MLA_LORA}+{MLA_ROPE}, {MLA_HEADS} heads, v_head_size {MLA_LORA}, fp16, block {MLA_BLOCK}, "
                f"{q_len} new token(s) after {past}; {THREADS} threads")  # fmt: skip
        for k in ("native", "portable"):
            rows.append(_row(f"{name}/{k}/{tag}", "step_time", ms[k], "ms", what))
        rows.append(_row(f"{name}/native_over_portable/{tag}", "step_time_ratio", ms["native"] / ms["portable"], "x"))


def run(quick: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    repeats = 5 if quick else 15
    rows: list[dict] = []
    _decode(rows, repeats, rng)
    _pool(rows, repeats, rng)
    _mla(rows, repeats, rng, quick)
    return rows


if __name__ == "__main__":
    print(format_table(run(quick="--quick" in sys.argv[1:])))
