"""Decode at DeepSeek-V3 attention dimensions natively on CUDA: LATENT (absorbed MLA) vs SEPARATE (un-absorbed).

One PagedAttention node per form, the same layer both ways:

* LATENT: 128 query heads over one latent row of 576 (512 compressed KV + 64 RoPE), ``v_head_size`` 512.
* SEPARATE: the un-absorbed layer, 128 heads of K (128 nope + 64 rope = 192) and V (128, zero-padded to 192: the
  op's SEPARATE layout has one head size, as FlashAttention-style MLA kernels pad V).

float16, block size 64, every sequence ``context - 1`` cached tokens + 1 new token, batch 1-64, context 1k-32k.
Caches are ``PagedSession`` OrtValues on the device (aliased in/out, no per-step copy). Per configuration: the best
of ``repeats`` steps after a warm-up, KV bytes read per step (batch x context x bytes per cached token), achieved
bandwidth = bytes / step time, and its fraction of the device's peak HBM bandwidth (memory clock x bus width x 2
from the driver, or the datasheet figure for known parts). A configuration whose pool would exceed
``--max-pool-gb`` (default 24) is reported as skipped, not run (SEPARATE at batch 64 x 32k is ~200 GB).

``python benchmarks/decode_dsv3_cuda.py`` on a CUDA machine (``scripts/gpu_check.sh`` runs it), a few minutes;
``--dry-run`` runs the same code on CPU (portable op) at a tiny size, to check it end to end without a GPU.
"""

from __future__ import annotations

import argparse
import ctypes
import math
import sys
import time
from dataclasses import dataclass

import numpy as np

from ortpa.bench._timing import row as _row

__all__ = ["Shape", "peak_bandwidth", "run"]

CUDA = ["CUDAExecutionProvider", "CPUExecutionProvider"]
CPU = ["CPUExecutionProvider"]
# datasheet HBM bandwidth (bytes/s) by device-name fragment: the driver's clock x width misses HBM3e's rate on some
DATASHEET = {"H200": 4.8e12, "H100 SXM": 3.35e12, "H100 PCIe": 2.0e12, "H100": 3.35e12, "A100-SXM4-80GB": 2.039e12,
             "A100 80GB PCIe": 1.935e12, "A100": 1.555e12, "L40S": 0.864e12, "L4": 0.3e12, "A10": 0.6e12,
             "T4": 0.32e12, "B200": 8.0e12}  # fmt: skip


@dataclass(frozen=True)
class Shape:
    heads: int = 128
    lora: int = 512
    rope: int = 64
    nope: int = 128
    v_head: int = 128
    block: int = 64


def _driver() -> ctypes.CDLL | None:
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        return lib if lib.cuInit(0) == 0 else None
    return None


def peak_bandwidth(device_id: int = 0) -> tuple[str, float | None, str]:
    """(device name, peak HBM bytes/s or None, where the figure comes from)."""
    lib = _driver()
    if lib is None:
        return "no CUDA driver", None, "none"
    dev, name = ctypes.c_int(), ctypes.create_string_buffer(256)
    lib.cuDeviceGet(ctypes.byref(dev), device_id)
    lib.cuDeviceGetName(name, 256, dev)
    label = name.value.decode(errors="replace")
    for fragment, bw in DATASHEET.items():
        if fragment in label:
            return label, bw, "datasheet"
    clock, width = ctypes.c_int(), ctypes.c_int()
    lib.cuDeviceGetAttribute(ctypes.byref(clock), 36, dev)  # CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE, kHz
    lib.cuDeviceGetAttribute(ctypes.byref(width), 37, dev)  # CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH, bits
    if clock.value <= 0 or width.value <= 0:
        return label, None, "unknown"
    return label, 2.0 * clock.value * 1e3 * width.value / 8, "driver clock x bus width"


def _layer(form: str, s: Shape, batch: int, context: int):
    """(model, feeds, num_blocks, KV bytes read per step) for one decode step of ``batch`` sequences."""
    from ortpa.ops.portable import paged_attention_model

    rng = np.random.default_rng(0)
    f16 = np.float16
    blocks_per_seq = -(-context // s.block)
    num_blocks = batch * blocks_per_seq + 1
    table = np.arange(batch * blocks_per_seq, dtype=np.int32).reshape(batch, blocks_per_seq)
    common = {
        "cumulative_sequence_length": np.arange(batch + 1, dtype=np.int32),
        "past_seqlens": np.full(batch, context - 1, np.int32),
        "block_table": table,
    }
    if form == "LATENT":
        h = s.lora + s.rope
        shapes = {"query": (batch, s.heads * h), "key": (batch, h), "key_cache": (num_blocks, s.block, 1, h)}
        attrs = dict(num_heads=s.heads, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=s.lora,
                     scale=1.0 / math.sqrt(s.nope + s.rope))  # fmt: skip
        per_token = h * 2
    else:
        h = s.nope + s.rope  # V padded from v_head to h
        shapes = {
            "query": (batch, s.heads * h),
            "key": (batch, s.heads * h),
            "value": (batch, s.heads * h),
            "key_cache": (num_blocks, s.block, s.heads, h),
            "value_cache": (num_blocks, s.block, s.heads, h),
        }
        attrs = dict(num_heads=s.heads, kv_num_heads=s.heads, scale=1.0 / math.sqrt(h))
        per_token = 2 * s.heads * h * 2
    stand_ins = {k: np.empty((1,) * len(v), f16) for k, v in shapes.items()}
    stand_ins = {k: np.lib.stride_tricks.as_strided(a, shapes[k], (0,) * len(shapes[k])) for k, a in stand_ins.items()}
    model = paged_attention_model({**stand_ins, **common}, attrs)
    feeds = {k: (rng.standard_normal(v) * 0.1).astype(f16) for k, v in shapes.items() if "cache" not in k}
    return model, {**feeds, **common}, num_blocks, batch * context * per_token


def _time(sess, feeds: dict, repeats: int, device: str) -> float:
    """Best step time with everything bound once: activations and the output on the device, the caches aliased
    in/out (the PagedSession's own OrtValues); no host copy inside the timed region beyond the small indices."""
    from ortpa.runtime.ortvalues import to_ortvalue

    ort_sess = sess.session._sess
    io = ort_sess.io_binding()
    keep = {}
    for name, array in feeds.items():
        where = device if array.dtype == np.float16 else "cpu"  # indices stay on the host; ORT places them
        keep[name] = to_ortvalue(array, where)
        io.bind_ortvalue_input(name, keep[name])
    for name, value in sess._values.items():
        io.bind_ortvalue_input(name, value)
    for out_name, in_name in sess._cache_outputs.items():
        io.bind_ortvalue_output(out_name, sess._values[in_name])
    io.bind_output("output", device)

    def step() -> None:
        ort_sess.run_with_iobinding(io)
        io.synchronize_outputs()  # the step is over when its output is

    step()  # warm-up: kernel selection, allocations
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        best = min(best, time.perf_counter() - t0)
    return best


def run(
    quick: bool = False,
    *,
    dry_run: bool = False,
    batches: tuple[int, ...] = (1, 8, 64),
    contexts: tuple[int, ...] = (1024, 8192, 32768),
    repeats: int = 10,
    max_pool_gb: float = 24.0,
) -> list[dict]:
    from ortpa.runtime.device import has_cuda
    from ortpa.runtime.session import PagedSession

    if not dry_run and not has_cuda():
        return [
            _row("decode_dsv3", "step_time", math.nan, "ms", "not available: no CUDA device (--dry-run runs it on CPU)")
        ]
    shape = Shape()
    providers = CUDA
    if dry_run:  # the same code on CPU at a tiny size
        shape = Shape(heads=4, lora=64, rope=16, nope=32, v_head=32, block=16)
        batches, contexts, repeats, providers = (1, 2), (32, 64), 2, CPU
    elif quick:
        batches, contexts, repeats = (1, 64), (1024, 32768), 5
    device, peak, source = peak_bandwidth() if not dry_run else ("cpu (dry run)", None, "none")
    rows: list[dict] = []
    for form in ("LATENT", "SEPARATE"):
        for batch in batches:
            for context in contexts:
                name = f"decode_dsv3/{form.lower()}/b{batch}/ctx{context}"
                model, feeds, num_blocks, kv_bytes = _layer(form, shape, batch, context)
                pool = num_blocks * kv_bytes / (batch * context) * shape.block
                if pool > max_pool_gb * 1e9:
                    rows.append(_row(name, "skipped", 1, "bool", f"pool {pool / 1e9:.0f} GB > {max_pool_gb:.0f} GB"))
                    continue
                sess = PagedSession(model, num_blocks=num_blocks, block_size=shape.block, providers=providers)
                native = bool(sess.session.native_nodes)
                if not dry_run and not native:
                    raise RuntimeError(f"{name}: the CUDA provider did not take the node natively")
                seconds = _time(sess, feeds, repeats, "cpu" if dry_run else "cuda")
                del sess
                bw = kv_bytes / seconds
                note = f"{device}; {'native' if native else 'portable'}; KV {kv_bytes / 1e6:.1f} MB/step"
                rows.append(_row(name, "step_time", seconds * 1e3, "ms", note))
                rows.append(_row(name, "kv_bandwidth", bw / 1e9, "GB/s", note))
                if peak:
                    rows.append(
                        _row(name, "fraction_of_peak", bw / peak, "x", f"peak {peak / 1e12:.2f} TB/s ({source})")
                    )
    latent = {
        r["name"].split("/", 2)[2]: r["value"] for r in rows if "/latent/" in r["name"] and r["metric"] == "step_time"
    }
    for r in list(rows):
        if "/separate/" in r["name"] and r["metric"] == "step_time":
            key = r["name"].split("/", 2)[2]
            if key in latent:
                rows.append(_row(f"decode_dsv3/ratio/{key}", "separate_over_latent", r["value"] / latent[key], "x",
                                 "step time, same layer un-absorbed / absorbed"))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    from ortpa.bench import format_table

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU (portable op): checks the script")
    p.add_argument("--quick", action="store_true", help="batch 1/64, context 1k/32k, 5 repeats")
    p.add_argument("--max-pool-gb", type=float, default=24.0)
    args = p.parse_args(argv)
    if not args.dry_run:
        import onnxruntime as ort

        if "CUDAExecutionProvider" not in ort.get_available_providers() or _driver() is None:
            print("decode_dsv3_cuda: no CUDA device / provider; use --dry-run to check the script on CPU")
            return 2
    print(format_table(run(args.quick, dry_run=args.dry_run, max_pool_gb=args.max_pool_gb)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
