"""MLA at DeepSeek-V2-Lite attention dims: the dense original against the converted paths, prefill and decode.

Model (``ortpa.testing.dense_mla``, random weights): one layer with V2-Lite's attention (hidden 2048, 16 heads,
kv_lora_rank 512, qk_nope 128, qk_rope 64, v_head 128, no q LoRA), an MLP of width 1 and a 64-token vocabulary,
so that the time is the attention layer's (projections, RoPE, the attention itself, o_proj). Four paths, timed
interleaved in one run, one intra-op thread each, CPU time of this process (the machine may be shared):

* ``dense``: the dense export on ONNX Runtime, as the original runs it (``past_key_values`` in, the latent cache
  re-expanded through ``kv_b_proj`` on every call);
* ``absorbed_native``: ``ortpa.convert(mla_prefill="absorbed")``, the LATENT PagedAttention node on ortpa's
  native kernel (``PagedSession``, aliased caches);
* ``absorbed_portable``: the same file with the node lowered to standard ops (``paged_attention="portable"``);
* ``expanded_native``: ``ortpa.convert(mla_prefill="expanded")`` (the default, ``ortpa.rewriter.mla_expanded``):
  a fresh prompt attends at 192 / 128 per head in standard ops; rows with a cached prefix (decode) go to the
  LATENT node on the native kernel.

Rows: ``prefill_ms/<path>/N`` (a fresh N-token prompt) and ``decode_ms/<path>/ctxN`` (one token after N cached
ones), ``*_ratio/<path>/...`` = path / dense from the same run (below 1: faster than the original), and
``max_abs_err/<path>/...``: the largest |logit - dense logit| of the timed run's own output (the last token's
row), held to the precision rule's logit bound of the conversion's cache dtype
(``ortpa.tolerances.precision_logit_bound``; float16 by default: PagedAttention caches and computes in a half
type, so a float32 original converts with float16 caches). A path past its bound raises
(:class:`MlaBenchMismatch`): a bench that times a wrong answer is no bench.

Lengths: prefill 256, 1024, 4096 and decode at 4096 (``quick``: prefill 64, decode at 128, for the tests);
``ORTPA_BENCH_MLA_PREFILL`` / ``ORTPA_BENCH_MLA_DECODE`` (comma lists) override, ``ORTPA_BENCH_REPEATS`` sets
the repeats. The decode cache holds random rows, the same in the dense ``past_key_values`` and the paged pool.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import onnx
import onnxruntime as ort

from ortpa.bench._timing import interleaved_ms, row
from ortpa.bench.mla_prefill import CONFIG as V2_LITE_ATTENTION
from ortpa.bench.runner import format_table
from ortpa.dtypes import dtype_name
from ortpa.errors import OrtpaError
from ortpa.providers import CPU
from ortpa.rewriter.pipeline import convert
from ortpa.runtime.kv import PagedKVCache
from ortpa.runtime.session import PagedSession
from ortpa.testing.dense_mla import build_dense_mla, dense_mla_weights
from ortpa.tolerances import precision_logit_bound

__all__ = ["CONFIG", "PATHS", "MlaBenchMismatch", "check_outputs", "run"]

BS = 16
THREADS = 1
# mla_prefill's DeepSeek-V2-Lite attention dims, one layer; the MLP and vocabulary out of the timing: this bench
# is about the attention layer
CONFIG = replace(V2_LITE_ATTENTION, layers=1, vocab=64, intermediate=1, max_position_embeddings=4096 + 64)

# path -> (convert's mla_prefill, PagedSession's paged_attention)
PATHS: dict[str, tuple[str, str]] = {
    "absorbed_native": ("absorbed", "native"),
    "absorbed_portable": ("absorbed", "portable"),
    "expanded_native": ("expanded", "native"),
}


class MlaBenchMismatch(OrtpaError, AssertionError):
    """A converted path's output is off the dense original's by more than the structure bound."""


def _options() -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = THREADS
    so.inter_op_num_threads = 1
    so.enable_cpu_mem_arena = False  # four sessions each keeping a long prompt's peak would hold it all at once
    return so


@dataclass
class _Case:
    """One timed shape: ``n`` new tokens after ``past`` cached ones; the cached rows (latent, roped k_pe)."""

    n: int
    past: int
    ids: np.ndarray  # [n]
    latent: np.ndarray  # [past, L]
    k_pe: np.ndarray  # [past, R]


def _case(n: int, past: int, rng) -> _Case:
    c = CONFIG
    return _Case(
        n,
        past,
        rng.integers(0, c.vocab, n).astype(np.int64),
        rng.standard_normal((past, c.kv_lora_rank)).astype(np.float32),
        rng.standard_normal((past, c.qk_rope)).astype(np.float32),
    )


def _dense_fn(sess: ort.InferenceSession, case: _Case) -> Callable[[], np.ndarray]:
    total = case.past + case.n
    feed = {
        "input_ids": case.ids[None],
        "attention_mask": np.ones((1, total), np.int64),
        "position_ids": np.arange(case.past, total, dtype=np.int64)[None],
        "past_key_values.0.key": case.latent[None, None],
        "past_key_values.0.value": case.k_pe[None, None],
    }
    return lambda: sess.run(["logits"], feed)[0][0, -1]


def _paged_fn(sess: PagedSession, case: _Case) -> Callable[[], np.ndarray]:
    """One step of one sequence; its bookkeeping is rebuilt before each run (every run sees the same state) and
    the cached rows are written where the paged cache keeps them: ``[latent | k_pe]`` at the sequence's slots."""
    (name,) = sess.cache_names
    pool = sess.cache(name)
    kv = PagedKVCache(sess.num_blocks, sess.block_size)
    kv.add_sequence(0, num_tokens=case.past)
    rows = pool.reshape(-1, pool.shape[-1])  # [blocks * block_size, L + R] (one latent "head")
    rows[kv.slots(0, 0, case.past)] = np.concatenate([case.latent, case.k_pe], axis=1).astype(pool.dtype)
    sess.write_cache(name, pool)
    declared = {i.name for i in sess.session.get_inputs()}

    def step() -> np.ndarray:
        kv = PagedKVCache(sess.num_blocks, sess.block_size)
        kv.add_sequence(0, num_tokens=case.past)
        feed = kv.plan_step([(0, case.n)]).model_feeds(
            case.ids,
            attention_metadata="attention_metadata" in declared,
            position_ids="position_ids" in declared,
        )
        return sess.run(feed, ["logits"])["logits"][-1]

    return step


def _timed(fns: dict[str, Callable[[], np.ndarray]], repeats: int, clock) -> tuple[dict, dict]:
    """(median ms, the output of each callable's last timed run)."""
    last: dict[str, np.ndarray] = {}

    def keeping(k: str, fn: Callable[[], np.ndarray]) -> Callable[[], None]:
        def call() -> None:
            last[k] = np.array(fn(), np.float32)

        return call

    ms = interleaved_ms({k: keeping(k, fn) for k, fn in fns.items()}, repeats, clock=clock)
    return ms, last


def check_outputs(where: str, out: dict[str, np.ndarray], cache_dtype) -> dict[str, float]:
    """Each path's max |logit - dense logit| (``out``: path -> the last token's logits, ``dense`` included);
    raises :class:`MlaBenchMismatch` where one is past ``precision_logit_bound(cache_dtype)``."""
    bound = precision_logit_bound(cache_dtype)
    errors = {}
    for k, logits in out.items():
        if k == "dense":
            continue
        err = float(np.abs(np.asarray(logits, np.float32) - out["dense"]).max())
        if not err <= bound:  # NaN fails too
            raise MlaBenchMismatch(
                f"ortpa bench mla_vs_dense: {where}, path {k}: expected logits within {bound:.3g} "
                f"(precision_logit_bound({dtype_name(cache_dtype)})) of the dense original's, found {err:.3g}"
            )
        errors[k] = err
    return errors


def _rows(kind: str, tag: str, ms: dict, out: dict, cache_dtype, note: str) -> list[dict]:
    rows = [row(f"{kind}_ms/{k}/{tag}", f"{kind}_time", v, "ms", note) for k, v in ms.items()]
    errors = check_outputs(f"{kind} {tag}", out, cache_dtype)
    bound = f"bound {precision_logit_bound(cache_dtype):.3g} ({dtype_name(cache_dtype)} cache)"
    for k in PATHS:
        rows.append(row(f"{kind}_ratio/{k}/{tag}", "path_over_dense", ms[k] / ms["dense"], "x", "same run"))
        rows.append(row(f"max_abs_err/{k}/{kind}/{tag}", "abs_logit_error", errors[k], "", bound))
    return rows


def _lengths(env: str, default: tuple[int, ...]) -> tuple[int, ...]:
    value = os.environ.get(env)
    return tuple(int(x) for x in value.split(",")) if value else default


def run(quick: bool = False) -> list[dict]:
    c = CONFIG
    rng = np.random.default_rng(0)
    repeats = int(os.environ.get("ORTPA_BENCH_REPEATS", 1 if quick else 3))
    prefill = _lengths("ORTPA_BENCH_MLA_PREFILL", (64,) if quick else (256, 1024, 4096))
    decode = _lengths("ORTPA_BENCH_MLA_DECODE", (128,) if quick else (4096,))
    dense_model = build_dense_mla(c, dense_mla_weights(c))
    dense = ort.InferenceSession(dense_model.SerializeToString(), _options(), providers=[CPU])
    num_blocks = -(-max([*prefill, *(n + 1 for n in decode)]) // BS) + 4
    converted: dict[str, onnx.ModelProto] = {}
    paged: dict[str, PagedSession] = {}
    for path, (form, impl) in PATHS.items():
        if form not in converted:
            converted[form] = convert(dense_model, mla_prefill=form, providers=())
        sess = PagedSession(
            converted[form],
            num_blocks=num_blocks,
            block_size=BS,
            providers=[CPU],
            sess_options=_options(),
            paged_attention=impl,
        )
        ran = set(sess.session.implementations.values())
        if ran != {"native-cpu" if impl == "native" else "portable"}:
            raise OrtpaError(f"ortpa bench mla_vs_dense: path {path}: expected the {impl} op, found {sorted(ran)}")
        paged[path] = sess
    del dense_model, converted
    (cache_dtype,) = {s.cache(n).dtype for s in paged.values() for n in s.cache_names}

    dims = f"V2-Lite attention: {c.heads} heads, L {c.kv_lora_rank}, nope {c.qk_nope}, rope {c.qk_rope}, v {c.v_head}"
    env = f"{THREADS} ORT thread, CPU time, median of {repeats} interleaved; {dtype_name(cache_dtype)} cache"
    env += f", block {BS}"
    rows: list[dict] = []
    shapes = (("prefill", [_case(n, 0, rng) for n in prefill]), ("decode", [_case(1, n, rng) for n in decode]))
    for kind, cases in shapes:
        for case in cases:
            fns = {"dense": _dense_fn(dense, case), **{k: _paged_fn(s, case) for k, s in paged.items()}}
            ms, out = _timed(fns, repeats, time.process_time)
            tag = str(case.n) if kind == "prefill" else f"ctx{case.past}"
            what = f"fresh {case.n}-token prompt" if kind == "prefill" else f"one token after {case.past}"
            rows += _rows(kind, tag, ms, out, cache_dtype, f"{dims}; {what}; {env}")
    return rows


if __name__ == "__main__":
    print(format_table(run(quick="--quick" in sys.argv[1:])))
