"""``ortpa.convert`` wall time and peak memory against layer count (small MLA config), plus one DeepSeek-V3 layer.

Each measurement runs in a fresh subprocess (``python -m ortpa.bench.convert --child LAYERS ...``) that
builds the dense model, then times ``convert`` and reports the peak resident memory during the call (VmHWM, reset
just before it; ``ru_maxrss`` where that is unavailable) minus the resident memory before it.
Rows (``run(quick)`` returns them; ``python -m ortpa.bench.convert [--quick]`` prints a table):

* ``convert/small/layersN``: wall time, time per layer, peak-RSS growth for N = 1, 2, 4, 8 (quick: 1, 2, 4).
* ``convert/small/linearity``: time(max N) / time(1); linear in layers is N (plus a fixed cost, so below it).
* ``convert/dsv3_layer`` (not quick): one layer at DeepSeek-V3 dimensions (hidden 7168, 128 heads, q_lora 1536,
  kv_lora 512, rope 64, nope 128, v 128; vocab 256, intermediate 256). Skipped with the reason in ``notes`` if
  it takes over 60 s or 8 GB.
"""

from __future__ import annotations

import gc
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from ortpa.bench.runner import format_table

__all__ = ["run"]

SMALL = dict(hidden=256, heads=8, q_lora_rank=128, kv_lora_rank=64, qk_nope=32, qk_rope=16, v_head=32,
             vocab=256, intermediate=256)  # fmt: skip
DSV3 = dict(hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
            vocab=256, intermediate=256)  # fmt: skip
TIME_LIMIT_S, MEM_LIMIT_GB = 60.0, 8.0


def _status_kb(key: str) -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _child(layers: int, dims: dict) -> dict:
    from ortpa import convert
    from ortpa.testing.dense_mla import DenseMlaConfig, build_dense_mla

    model = build_dense_mla(DenseMlaConfig(layers=layers, **dims))
    gc.collect()
    try:  # Linux: reset the peak-RSS mark (VmHWM) so building the model's weights does not hide convert's peak
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        before = _status_kb("VmRSS")
    except OSError:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    t0 = time.perf_counter()
    converted = convert(model)
    seconds = time.perf_counter() - t0
    after = _status_kb("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    paged = sum(n.op_type == "PagedAttention" for n in converted.graph.node)
    return {"seconds": seconds, "rss_delta_mb": (after - before) / 1024, "rss_peak_mb": after / 1024,
            "paged_nodes": paged}  # fmt: skip


def _measure(layers: int, dims: dict, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "ortpa.bench.convert", "--child", str(layers), json.dumps(dims)]
    # the ulimit keeps an oversized conversion from taking the machine down; it fails instead
    limit_kb = int(MEM_LIMIT_GB * 1024 * 1024)
    shell = f"ulimit -v {limit_kb * 2} && exec " + " ".join(f"'{c}'" for c in cmd)
    proc = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"child exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _row(name: str, metric: str, value: float, unit: str, notes: str = "") -> dict:
    return {"name": name, "metric": metric, "value": round(float(value), 4), "unit": unit, "notes": notes}


def run(quick: bool = False) -> list[dict]:
    counts = (1, 2, 4) if quick else (1, 2, 4, 8)
    dims = ", ".join(f"{k} {v}" for k, v in SMALL.items())
    rows: list[dict] = []
    times: dict[int, float] = {}
    for n in counts:
        r = _measure(n, SMALL, timeout=600)
        times[n] = r["seconds"]
        note = f"{dims}; fresh subprocess, {r['paged_nodes']} PagedAttention nodes"
        rows.append(_row(f"convert/small/layers{n}", "wall_time", r["seconds"], "s", note))
        rows.append(_row(f"convert/small/layers{n}", "time_per_layer", r["seconds"] / n, "s", note))
        rows.append(_row(f"convert/small/layers{n}", "peak_rss_growth", r["rss_delta_mb"], "MB",
                         f"peak RSS during convert - RSS before; peak {r['rss_peak_mb']:.0f} MB"))  # fmt: skip
    top = max(counts)
    rows.append(_row("convert/small/linearity", f"time_ratio_{top}_over_1", times[top] / times[1], "x",
                     f"linear in layers is {top}.0 (a fixed cost pulls it below)"))  # fmt: skip
    if not quick:
        dims3 = ", ".join(f"{k} {v}" for k, v in DSV3.items())
        try:
            r = _measure(1, DSV3, timeout=TIME_LIMIT_S + 60)  # + build time; the convert itself is checked below
            if r["seconds"] > TIME_LIMIT_S or r["rss_peak_mb"] > MEM_LIMIT_GB * 1024:
                raise RuntimeError(f"over budget: {r['seconds']:.1f} s, peak {r['rss_peak_mb']:.0f} MB")
            rows.append(_row("convert/dsv3_layer", "wall_time", r["seconds"], "s", f"1 layer: {dims3}"))
            rows.append(_row("convert/dsv3_layer", "peak_rss_growth", r["rss_delta_mb"], "MB",
                             f"peak RSS during convert - RSS before; peak {r['rss_peak_mb']:.0f} MB"))  # fmt: skip
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as e:
            reason = f"timed out (> {TIME_LIMIT_S:.0f} s + build)" if isinstance(e, subprocess.TimeoutExpired) else e
            rows.append(_row("convert/dsv3_layer", "skipped", 1, "bool", f"{dims3}; skipped: {reason}"))
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(_child(int(sys.argv[2]), json.loads(sys.argv[3]))))
    else:
        print(format_table(run(quick="--quick" in sys.argv[1:])))
