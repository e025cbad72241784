"""``ortpa convert`` at DeepSeek-V2-Lite dimensions: peak private memory, throughput against ``cp``, session start-up.

For each layer count (quick: 2, 4; full: 2, 4, 8, 16) the dense model is written straight to a temp folder with
external data (:func:`ortpa.testing.dense_mla_file.write_dense_mla`: hidden 2048, 16 heads, no q LoRA, kv_lora 512,
rope 64, nope 128, v 128, intermediate 10944, vocab 32000; ~0.33 GB per layer + 0.52 GB of embeddings), then in
the same run:

* ``cp`` of the model and its data file (page cache dropped first where allowed), the disk's MB/s;
* ``ortpa convert --quiet`` in a subprocess (imports done, then the page cache dropped, then timed with a sync),
  its peak private memory sampled from ``/proc/<pid>/status`` ``RssAnon`` every 20 ms (anonymous RSS:
  memory-mapped weights the kernel can drop do not count), against the target 1 GB + 2x the largest tensor;
  MB/s of weights;
* session start-up of the converted model: ``ortpa.InferenceSession`` (portable path, CPU) against plain
  ``onnxruntime.InferenceSession`` of the same model lowered to the portable op and saved next to it (sharing
  its data file: ORT has no CPU kernel for PagedAttention, so this is what ORT itself loads), each the best of
  two fresh subprocesses: wall time after imports and peak private memory; the dense original for reference.

Verification (issue 24): ``convert/verify/{0.1GB,1GB,3GB}``: the same ``ortpa convert`` child with and without
``--no-verify``: ``verify_seconds`` (the difference), ``verify_share``, ``peak_rss_anon_verified`` and its ratio to
the input's size (``python -m ortpa.bench.convert --verify-only [--float16] [0.1GB 1GB 3GB]`` runs only these;
``--float16``: float16 originals of the same sizes, ``convert/verify/float16/...``).

Rows: ``convert/v2lite/layersN`` with ``peak_rss_anon`` (target in its notes), ``convert_seconds``,
``convert_mb_s``, ``cp_mb_s``, ``convert_over_cp``, ``session_startup_ratio``, ``session_rss_ratio``.
Folders are deleted after each layer count.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ortpa.bench._timing import row as _row

__all__ = ["V2_LITE", "run"]

V2_LITE = dict(hidden=2048, heads=16, q_lora_rank=None, kv_lora_rank=512, qk_nope=128, qk_rope=64, v_head=128,
               vocab=32000, intermediate=10944)  # fmt: skip
_MB = 1e6


def _anon_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _peak_anon(cmd: list[str], timeout: float) -> tuple[float, float, str]:
    """(seconds, peak anonymous RSS in MB, stderr tail) of ``cmd`` run to completion."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _anon_kb(proc.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        done.set()
        sampler.join()
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[2:4]} exited {proc.returncode}: {err.strip().splitlines()[-3:]}")
    return seconds, peak / 1024, (out or "").strip()


def _drop_caches() -> None:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("1")
    except OSError:
        pass  # not root: the cp and the convert then both read from a warm page cache (same footing)


def _files_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.iterdir())


_SESSION_CHILD = """
import sys, time, json
import onnxruntime as ort
import ortpa
t0 = time.perf_counter()
if sys.argv[1] == "ortpa":
    s = ortpa.InferenceSession(sys.argv[2], providers=["CPUExecutionProvider"])
else:
    s = ort.InferenceSession(sys.argv[2], providers=["CPUExecutionProvider"])
print(json.dumps({"seconds": time.perf_counter() - t0}))
"""

# imports first, then the page cache is dropped (the libraries too would be cold otherwise), then the timed part
_CONVERT_CHILD = """
import sys, time, json, os
from pathlib import Path
from ortpa.cli import main
try:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("1")
except OSError:
    pass
t0 = time.perf_counter()
rc = main(["convert", sys.argv[1], sys.argv[2], "--quiet", *sys.argv[3:]])
os.sync()
print(json.dumps({"seconds": time.perf_counter() - t0, "rc": rc}))
"""


def _session(kind: str, path: Path, repeats: int = 2) -> tuple[float, float]:
    """Best of ``repeats`` fresh processes (the machine is shared): start-up seconds, peak private MB."""
    runs = []
    for _ in range(repeats):
        _, peak, out = _peak_anon([sys.executable, "-c", _SESSION_CHILD, kind, str(path)], timeout=900)
        runs.append((json.loads(out.splitlines()[-1])["seconds"], peak))
    return min(r[0] for r in runs), min(r[1] for r in runs)


def _lowered_baseline(paged: Path) -> Path:
    """The portable lowering of the paged model as a file next to it, sharing its data file: what ORT itself
    loads when ortpa runs the model on CPU, so plain ``onnxruntime.InferenceSession`` can open "the same file"."""
    import onnx

    from ortpa.ops.portable import lower_to_portable

    header = onnx.load(str(paged), load_external_data=False)
    out = paged.parent / "lowered.onnx"
    onnx.save_model(lower_to_portable(header), str(out))
    return out


def measure(layers: int, root: Path) -> list[dict]:
    from ortpa.testing.dense_mla import DenseMlaConfig
    from ortpa.testing.dense_mla_file import write_dense_mla

    c = DenseMlaConfig(layers=layers, **V2_LITE)
    dense = write_dense_mla(c, root / "dense" / "model.onnx")
    size = _files_bytes(dense.parent)
    largest = max(c.vocab * c.hidden, c.hidden * c.intermediate) * 4
    name = f"convert/v2lite/layers{layers}"
    rows = []

    _drop_caches()
    t0 = time.perf_counter()
    shutil.copytree(dense.parent, root / "copy")
    os.sync()
    cp_s = time.perf_counter() - t0
    shutil.rmtree(root / "copy")

    out = root / "paged" / "paged.onnx"
    _, peak, text = _peak_anon([sys.executable, "-c", _CONVERT_CHILD, str(dense), str(out)], timeout=3600)
    seconds = json.loads(text.splitlines()[-1])["seconds"]
    target = 1024 + 2 * largest / 2**20
    note = f"input {size / _MB:.0f} MB, largest tensor {largest / _MB:.0f} MB"
    rows.append(_row(name, "peak_rss_anon", peak, "MB", f"{note}; target <= {target:.0f} MB (1 GB + 2x largest)"))
    rows.append(_row(name, "convert_seconds", seconds, "s", note))
    rows.append(_row(name, "convert_mb_s", size / _MB / seconds, "MB/s",
                     "cold page cache, ortpa convert's main() + sync, imports excluded"))  # fmt: skip
    rows.append(_row(name, "cp_mb_s", size / _MB / cp_s, "MB/s", "cold page cache, copy of the same files + sync"))
    rows.append(_row(name, "convert_over_cp", cp_s / seconds, "x", "convert speed / cp speed"))

    ortpa_s, ortpa_rss = _session("ortpa", out)
    ort_s, ort_rss = _session("ort", _lowered_baseline(out))
    dense_s, _ = _session("ort", dense, repeats=1)
    rows.append(_row(name, "session_startup_ratio", ortpa_s / ort_s, "x",
                     f"ortpa.InferenceSession(paged) {ortpa_s:.2f} s / ort.InferenceSession(lowered file) "
                     f"{ort_s:.2f} s (dense original {dense_s:.2f} s); target <= 2"))  # fmt: skip
    rows.append(_row(name, "session_rss_ratio", ortpa_rss / max(ort_rss, 1), "x",
                     f"peak private memory {ortpa_rss:.0f} MB / {ort_rss:.0f} MB; target <= 1.3"))  # fmt: skip
    return rows


# Verification's cost (issue 24) at three model sizes: (label, config, layers). 0.1 GB is a narrower model
# (hidden 512, vocab 8000); 1 and 3 GB are DeepSeek-V2-Lite dimensions with 1 and 7 layers.
SMALL = dict(hidden=512, heads=8, q_lora_rank=None, kv_lora_rank=128, qk_nope=64, qk_rope=32, v_head=64,
             vocab=8000, intermediate=2048)  # fmt: skip
VERIFY_SIZES = (("0.1GB", SMALL, 3), ("1GB", V2_LITE, 1), ("3GB", V2_LITE, 7))
# the same sizes in float16 (twice the layers per byte): an original that computes in float16, whose
# verification runs a float32 twin of both sides, the original's as the reference (docs/verification.md)
HALF_VERIFY_SIZES = (("0.1GB", SMALL, 10), ("1GB", V2_LITE, 4), ("3GB", V2_LITE, 16))


def measure_verify(label: str, dims: dict, layers: int, root: Path, *, half: bool = False) -> list[dict]:
    """``ortpa convert`` with and without ``--no-verify`` on the same model: the verification's seconds (the
    difference), its share of the conversion, and both runs' peak private memory. ``half``: the model in
    float16 (:func:`ortpa.testing.half_file.float16_copy`)."""
    from ortpa.testing.dense_mla import DenseMlaConfig
    from ortpa.testing.dense_mla_file import write_dense_mla
    from ortpa.testing.half_file import float16_copy

    c = DenseMlaConfig(layers=layers, **dims)
    dense = write_dense_mla(c, root / "dense" / "model.onnx")
    if half:
        dense = float16_copy(dense, root / "half" / "model.onnx")
        shutil.rmtree(root / "dense")
    size = _files_bytes(dense.parent)
    name = f"convert/verify{'/float16' if half else ''}/{label}"
    runs = {}
    for flag in ("--no-verify", None):
        out = root / ("plain" if flag else "verified") / "paged.onnx"
        args = [sys.executable, "-c", _CONVERT_CHILD, str(dense), str(out), *([flag] if flag else [])]
        _, peak, text = _peak_anon(args, timeout=3600)
        runs[flag] = (json.loads(text.splitlines()[-1])["seconds"], peak)
        shutil.rmtree(out.parent, ignore_errors=True)
    (plain_s, plain_peak), (verified_s, verified_peak) = runs["--no-verify"], runs[None]
    note = f"input {size / _MB:.0f} MB, {layers} layers"
    return [
        _row(
            name,
            "verify_seconds",
            verified_s - plain_s,
            "s",
            f"{note}; convert {verified_s:.1f} s verified, {plain_s:.1f} s with --no-verify",
        ),
        _row(name, "verify_share", (verified_s - plain_s) / verified_s, "x", "of the verified conversion's time"),
        _row(
            name,
            "peak_rss_anon_verified",
            verified_peak,
            "MB",
            f"{note}; --no-verify: {plain_peak:.0f} MB (every session reads the weights memory-mapped)",
        ),
        _row(name, "peak_rss_verified_over_size", verified_peak / (size / 2**20), "x", "peak private MB / input MB"),
    ]


def run(quick: bool = False, counts: tuple[int, ...] | None = None, verify_sizes=None) -> list[dict]:
    counts = counts or ((2, 4) if quick else (2, 4, 8, 16))
    sizes = verify_sizes if verify_sizes is not None else (VERIFY_SIZES[:2] if quick else VERIFY_SIZES)
    rows: list[dict] = []
    for n in counts:
        root = Path(tempfile.mkdtemp(prefix=f"ortpa-bench-convert-{n}-"))
        try:
            rows += measure(n, root)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows + _verify_rows(sizes)


def _verify_rows(sizes, *, half: bool = False) -> list[dict]:
    """:func:`measure_verify` for each ``(label, dims, layers)`` of ``sizes``, each in a temp folder of its own."""
    rows: list[dict] = []
    for label, dims, layers in sizes:
        root = Path(tempfile.mkdtemp(prefix=f"ortpa-bench-verify-{label}-"))
        try:
            rows += measure_verify(label, dims, layers, root, half=half)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return rows


if __name__ == "__main__":
    from ortpa.bench import format_table

    if "--verify-only" in sys.argv[1:]:
        wanted = [a for a in sys.argv[1:] if a.endswith("GB")]
        half = "--float16" in sys.argv[1:]
        sizes = tuple(s for s in (HALF_VERIFY_SIZES if half else VERIFY_SIZES) if not wanted or s[0] in wanted)
        print(format_table(_verify_rows(sizes, half=half)))
    else:
        layers = tuple(int(a) for a in sys.argv[1:] if a.isdigit())
        print(format_table(run(quick="--quick" in sys.argv[1:], counts=layers or None)))
