"""LATENT (absorbed MLA) against the same attention un-absorbed as SEPARATE (per-head K and V), one layer.

The question a user weighs before converting an MLA model: the absorbed layout caches one latent row per token
(``kv_lora_rank + qk_rope`` channels, shared by every head) but attends in that wide latent space; un-absorbed,
the cache holds every head's K (``qk_nope + qk_rope``) and V (``v_head``, zero-padded to K's width, since
SEPARATE has one head size) and attends in the narrow per-head space. Both run here as one
``com.microsoft::PagedAttention`` node on the same runtime (ONNX Runtime CPU, ``ortpa.ops.portable``), same
heads and dims, fp16 activations and caches, aliased (in-place) caches, block size 16, batch 1.

Rows (``run(quick)`` returns them; ``python -m ortpa.bench.latent_vs_separate [--quick]`` prints a table):

* ``kv_bytes_per_token/{latent,separate}``: cache bytes one token adds to one layer, and their ratio; also at
  DeepSeek-V3's 128 heads (computed, not timed).
* ``decode_ms/{latent,separate}/ctxN``: one new token after N cached ones; ``decode_ratio/ctxN`` =
  separate / latent step time (> 1: LATENT is faster).
* ``prefill_ms/{latent,separate}/ctxN``: a chunk of 256 new tokens ending at context N (N - 256 cached);
  ``prefill_ratio/ctxN`` the same ratio.

Only the attention op is timed: the projections around it (LATENT: q through W_UK, output through W_UV;
SEPARATE: the new token's latent through kv_b_proj) cost per new token whatever the context, and are the same
order for both.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import onnxruntime as ort

from ortpa.bench._timing import aliased_step, interleaved_ms, row
from ortpa.bench.runner import format_table
from ortpa.ops.portable import portable_single_node_model
from ortpa.providers import CPU

__all__ = ["run"]

# DeepSeek-V2-Lite / ortpa.bench.decode_mla attention dims; DeepSeek-V3 has 128 heads (KV bytes row only).
HEADS, LORA, ROPE, NOPE, V_HEAD, BS = 16, 512, 64, 128, 128, 16
V3_HEADS = 128
PREFILL_CHUNK = 256
F16 = np.float16


def _latent_bytes() -> int:
    return (LORA + ROPE) * 2


def _separate_bytes(heads: int, padded: bool = True) -> int:
    k = NOPE + ROPE
    return heads * (k + (k if padded else V_HEAD)) * 2


def _inputs(layout: str, q: int, past: int, rng) -> tuple[dict, dict]:
    """Inputs and attributes of one sequence: ``q`` new tokens after ``past`` cached ones."""
    total = past + q
    blocks = -(-total // BS)
    table = rng.permutation(blocks + 1)[:blocks].astype(np.int32)[None]
    common = {
        "cumulative_sequence_length": np.array([0, q], np.int32),
        "past_seqlens": np.array([past], np.int32),
        "block_table": table,
    }
    scale = float(1.0 / np.sqrt(NOPE + ROPE))  # the model's softmax scale, in either layout

    def act(*shape):
        return (rng.standard_normal(shape) * 0.5).astype(F16)

    if layout == "LATENT":
        width = LORA + ROPE
        x = {"query": act(q, HEADS * width), "key": act(q, width), "key_cache": act(blocks + 1, BS, 1, width)}
        attrs = {"num_heads": HEADS, "kv_num_heads": 1, "kv_cache_layout": "LATENT", "v_head_size": LORA,
                 "scale": scale}  # fmt: skip
    else:
        h = NOPE + ROPE
        value = np.zeros((q, HEADS, h), F16)
        value[:, :, :V_HEAD] = act(q, HEADS, V_HEAD)
        x = {
            "query": act(q, HEADS * h),
            "key": act(q, HEADS * h),
            "value": value.reshape(q, HEADS * h),
            "key_cache": act(blocks + 1, BS, HEADS, h),
            "value_cache": act(blocks + 1, BS, HEADS, h),
        }
        attrs = {"num_heads": HEADS, "kv_num_heads": HEADS, "scale": scale}
    return {**x, **common}, attrs


def _session(x: dict, attrs: dict, threads: int) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    model = portable_single_node_model(x, attrs)
    return ort.InferenceSession(model.SerializeToString(), so, providers=[CPU])


def run(quick: bool = False) -> list[dict]:
    rng = np.random.default_rng(0)
    contexts = (256, 1024) if quick else (256, 1024, 2048, 4096, 8192)
    repeats = 3 if quick else 5
    threads = os.cpu_count() or 1
    env = f"ORT {ort.__version__} CPU, {threads} intra-op threads (1 inter-op), median of {repeats}, interleaved"
    dims = f"{HEADS} heads, L {LORA}, rope {ROPE}, nope {NOPE}, v {V_HEAD}, fp16, block {BS}"
    lat, sep = _latent_bytes(), _separate_bytes(HEADS)
    rows = [
        row("kv_bytes_per_token/latent", "bytes", lat, "B", f"one layer: latent {LORA} + rope {ROPE}, fp16"),
        row("kv_bytes_per_token/separate", "bytes", sep, "B",
             f"one layer: {HEADS} heads x (K {NOPE + ROPE} + V {V_HEAD} padded to {NOPE + ROPE}), fp16"),
        row("kv_bytes_ratio/separate_over_latent", "ratio", sep / lat, "x",
             f"{_separate_bytes(HEADS, padded=False) / lat:.1f}x without V padding"),
        row(f"kv_bytes_ratio/separate_over_latent/{V3_HEADS}_heads", "ratio",
             _separate_bytes(V3_HEADS, padded=False) / lat, "x", "DeepSeek-V3 (128 heads), V unpadded; computed"),
    ]  # fmt: skip
    for phase, q in (("decode", 1), ("prefill", PREFILL_CHUNK)):
        sessions: dict[str, ort.InferenceSession] = {}
        for ctx in contexts:
            if ctx < q:
                continue
            steps = {}
            for layout in ("LATENT", "SEPARATE"):
                x, attrs = _inputs(layout, q, ctx - q, rng)
                sess = sessions.get(layout) or sessions.setdefault(layout, _session(x, attrs, threads))
                steps[layout] = aliased_step(sess, x)
            # round-robin: a burst of load from other processes hits both layouts alike
            ms = interleaved_ms(steps, repeats if phase == "decode" else max(2, repeats // 2))
            for layout in ("LATENT", "SEPARATE"):
                what = f"{q} new token{'s' * (q > 1)} at context {ctx}"
                rows.append(row(f"{phase}_ms/{layout.lower()}/ctx{ctx}", "step_time", ms[layout], "ms",
                                 f"{what}; {dims}; {env}"))  # fmt: skip
            rows.append(row(f"{phase}_ratio/ctx{ctx}", "separate_over_latent", ms["SEPARATE"] / ms["LATENT"], "x",
                             "> 1: LATENT is faster"))  # fmt: skip
    return rows


if __name__ == "__main__":
    print(format_table(run(quick="--quick" in sys.argv[1:])))
