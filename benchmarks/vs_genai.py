"""onnxruntime-genai vs ortpa on the same genai builder model, on CPU: tokens/s at 1, 4 and 16 concurrent requests.

The model is built at run time (never committed): a Llama config of ~58M parameters (hidden 512, 8 layers,
8 query / 4 KV heads of 64, vocab 32000, seeded random weights), made by the onnxruntime-genai builder at fp32
(``-p fp32 -e cpu``: GroupQueryAttention); ``--deep``: SmolLM-135M's architecture instead (30 layers, ~135M
parameters, random weights: no trained checkpoint is reachable offline). onnxruntime-genai depends on the
``onnxruntime`` CPU wheel, which cannot share an environment with ortpa's ``onnxruntime-gpu``, so generation with
genai runs in a subprocess of the python given by ``--genai-python`` (or the ``ORTPA_GENAI_PYTHON`` environment
variable under ``ortpa bench``).
The builder needs torch and transformers: it runs in genai's python when that has them, else in this python
(which has them with the ``export`` extra) from genai's installed ``builder.py``.

The same file is converted by ``ortpa convert`` and run by :class:`ortpa.Engine` (CPU, portable
PagedAttention). Workloads, greedy, the same for both: 1, 4 and 16 requests submitted together
(onnxruntime-genai: one generator over the batch; ortpa: continuous batching), prompts of 64 tokens, 32 new
tokens each (``--quick``: 16 and 8). Both sides run with 2 intra-op threads and 1 inter-op thread (genai: its
``genai_config.json`` session options), on the same CPUs (``--cpus``, default all: ``sched_setaffinity`` here,
``taskset`` for genai); times are wall seconds of the generation alone (build, conversion and session creation
excluded). The two sides alternate round by round (a burst of outside load hits both alike) and each row is the
median of ``--rounds`` rounds; the ratio is of the medians. Every round of either side runs in a fresh process
(model loaded, one warm-up generation, then the timed one), as genai's always did: six consecutive processes of
the Engine, each timing the same one-request generation four times, had medians of 129-144 tokens/s on this
machine, so one long-lived process would be one draw for all its rounds while the other side's were many. Rows
record both ONNX Runtime versions and the load average before and after. Targets: ortpa / genai >= 1.0 at 1
request, >= 1.3 at 16.

Both sides keep ONNX Runtime's default for the CPU pool, spinning (genai's ``genai_config.json`` has no key for
it). ``vs_genai.1.nospin`` and ``vs_genai.16.nospin``: ortpa with ``session.intra_op.allow_spinning=0``, in the same
alternated rounds (a process of its own each): faster where other processes share the cores, slower on a quiet machine
(docs/native.md, "Threads").

``vs_genai.ort_release.1`` and ``.16``: genai's own model, one decode step, timed with plain ONNX Runtime in genai's
python and in this one, alternated (time ratio, ortpa's ORT over genai's): the part of the Engine rows that is the
two ONNX Runtime releases (genai 0.18 ships with ORT 1.32; ``onnxruntime-gpu``, which ortpa installs, is at 1.31.1
on this index), not either side's work.

``vs_genai.host.1`` and ``vs_genai.host.16``: the share of an ortpa decode step spent outside ONNX Runtime's run
(the driver loop: index tensors, sampling, Python between runs; target < 10% at one request).

Each concurrency also gets a ``vs_genai.N.cpu`` row: the ratio of tokens per CPU second of each side's process,
which the load of other processes disturbs far less than wall time (with ``--threads 1`` it is the work each side
does per token). ``--work DIR`` keeps the built and converted models in ``DIR`` and reuses them on the next run.

Rows say "not available" (value ``nan``) instead of failing when genai's python is not given or cannot build
the model, or when ``ortpa convert`` refuses the model (the reason is in the notes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from ortpa.bench._timing import row as _row

__all__ = ["run"]

ROOT = Path(__file__).resolve().parents[1]
CONFIG = {
    "model_type": "llama",
    "vocab_size": 32000,
    "hidden_size": 512,
    "intermediate_size": 1536,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# --deep: SmolLM-135M's architecture (30 layers; hidden 576, 9 query / 3 KV heads of 64, vocab 49152, tied)
DEEP = {**CONFIG, "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 2048,
        "rope_theta": 100000.0, "tie_word_embeddings": True}  # fmt: skip
THREADS = 2
CONCURRENCY = (1, 4, 16)
TARGETS = {1: 1.0, 16: 1.3}  # ortpa / genai tokens/s (issue 39)
NOSPIN_ROWS = (1, 16)  # concurrencies also run with ortpa's pool not spinning (vs_genai.N.nospin)
ROUNDS = 5

# Runs in genai's python: build the seeded Hugging Face folder (weights and tokenizer, as the fixture script
# does) and call the builder.
_BUILD = textwrap.dedent(
    """
    import json, subprocess, sys
    sys.path.insert(0, {scripts!r})
    import make_fixtures_formats as mf
    cfg, hf, out = json.loads({cfg!r}), {hf!r}, {out!r}
    mf.build_hf_dir(cfg, __import__("pathlib").Path(hf))
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", hf, "-o", out, "-p", "fp32", "-e", "cpu",
           "-c", out + "_cache"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit("builder failed: " + (proc.stderr or proc.stdout)[-2000:])
    """
)

# Runs in genai's python: greedy generation of a batch of prompts; prints JSON {seconds, tokens}.
_GENERATE = textwrap.dedent(
    """
    import json, time
    import onnxruntime_genai as og
    prompts, new_tokens, threads = json.loads({prompts!r}), {new_tokens}, {threads}
    config = og.Config({model_dir!r})
    model = og.Model(config)

    def once(batch):
        params = og.GeneratorParams(model)
        length = len(batch[0]) + new_tokens
        params.set_search_options(max_length=length, min_length=length, do_sample=False, batch_size=len(batch))
        gen = og.Generator(model, params)
        gen.append_tokens(batch)
        while not gen.is_done():
            gen.generate_next_token()
        return sum(len(gen.get_sequence(i)) - len(batch[i]) for i in range(len(batch)))

    import onnxruntime
    once(prompts[:1])  # warm-up
    t, c = time.perf_counter(), time.process_time()
    tokens = once(prompts)
    print(json.dumps({{"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - c, "tokens": tokens,
                      "genai": og.__version__,
                      "ort": onnxruntime.__version__}}))
    """
)


# Runs in either python: one decode step of genai's own model (GroupQueryAttention, past 80) with plain ONNX Runtime,
# median of 40 runs in ms: the same file on genai's ORT release and on ortpa's (vs_genai.ort_release.N).
_STEP = textwrap.dedent(
    """
    import json, time
    import numpy as np, onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = {threads}, 1
    s = ort.InferenceSession({model!r}, so, providers=["CPUExecutionProvider"])
    batch, past, rng = {batch}, 80, np.random.default_rng(0)
    feeds = {{}}
    for i in s.get_inputs():
        if i.name == "input_ids":
            feeds[i.name] = np.ones((batch, 1), np.int64)
        elif i.name == "attention_mask":
            feeds[i.name] = np.ones((batch, past + 1), np.int64)
        else:
            feeds[i.name] = rng.random((batch, {kv_heads}, past, {head_dim}), dtype=np.float32)
    for _ in range(5):
        s.run(None, feeds)
    times = []
    for _ in range(40):
        t = time.perf_counter()
        s.run(None, feeds)
        times.append(time.perf_counter() - t)
    print(json.dumps({{"ms": 1000 * float(np.median(times)), "ort": ort.__version__}}))
    """
)


def _release_rows(genai_python: str, model: Path, config: dict, threads: int, rounds: int, cpus, notes: str):
    """vs_genai.ort_release.N: genai's model, one decode step, on genai's ORT release over ortpa's (time ratio:
    above 1, genai's release alone runs the same file faster; the Engine rows carry that difference)."""
    rows = []
    for batch in (1, 16):
        kv, head = config["num_key_value_heads"], config["head_dim"]
        code = _STEP.format(threads=threads, model=str(model), batch=batch, kv_heads=kv, head_dim=head)
        theirs, ours, versions = [], [], ""
        for _ in range(rounds):
            try:
                a = json.loads(_subprocess(genai_python, code, timeout=600, cpus=cpus))
                b = json.loads(_subprocess(sys.executable, code, timeout=600, cpus=cpus))
            except (RuntimeError, subprocess.SubprocessError, ValueError) as exc:
                rows.append(_row(f"vs_genai.ort_release.{batch}", "time_ratio", math.nan, "x",
                                 f"not available: {str(exc)[-300:]}"))  # fmt: skip
                ours = []
                break
            theirs.append(a["ms"])
            ours.append(b["ms"])
            versions = f"ORT {a['ort']} (genai's) vs {b['ort']} (ortpa's)"
        if not ours:
            continue
        t, o = statistics.median(theirs), statistics.median(ours)
        rows.append(_row(f"vs_genai.ort_release.{batch}", "time_ratio", round(o / t, 2), "x",
                         f"genai's model, one decode step at batch {batch}, past 80: {versions}, medians "
                         f"{t:.2f} / {o:.2f} ms; {notes}"))  # fmt: skip
    return rows


def _genai_options(model_dir: Path, threads: int = THREADS) -> None:
    """Give genai the same thread count as ortpa (session options in genai_config.json)."""
    path = model_dir / "genai_config.json"
    cfg = json.loads(path.read_text())
    opts = cfg["model"]["decoder"].setdefault("session_options", {})
    opts["intra_op_num_threads"] = threads
    opts["inter_op_num_threads"] = 1
    path.write_text(json.dumps(cfg, indent=2))


# Runs in genai's python: where its builder script is (importing it would import torch).
_BUILDER_PATH = (
    "import importlib.util, os; "
    "print(os.path.join(importlib.util.find_spec('onnxruntime_genai').submodule_search_locations[0], "
    "'models', 'builder.py'))"
)


def _build(genai_python: str, hf: str, out: str, config: dict) -> None:
    """Build the seeded Hugging Face folder and run genai's builder on it: in genai's python if it has torch,
    else here, from genai's own ``builder.py`` (a script that imports its siblings from its folder)."""
    code = _BUILD.format(scripts=str(ROOT / "scripts"), cfg=json.dumps(config), hf=hf, out=out)
    proc = subprocess.run([genai_python, "-c", code], capture_output=True, text=True, timeout=1800)
    if proc.returncode == 0:
        return
    if "No module named" not in (proc.stderr or ""):
        raise RuntimeError((proc.stderr or proc.stdout)[-300:])
    sys.path.insert(0, str(ROOT / "scripts"))
    import make_fixtures_formats as mf

    mf.build_hf_dir(config, Path(hf))
    builder = subprocess.run([genai_python, "-c", _BUILDER_PATH], capture_output=True, text=True, check=True)
    cmd = [sys.executable, builder.stdout.strip(), "-i", hf, "-o", out, "-p", "fp32", "-e", "cpu", "-c", out + "_cache"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise RuntimeError("builder failed: " + (proc.stderr or proc.stdout)[-300:])


def _subprocess(python: str, code: str, timeout: float, cpus: list[int] | None = None) -> str:
    pin = ["taskset", "-c", ",".join(map(str, cpus))] if cpus else []
    proc = subprocess.run([*pin, python, "-c", code], capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise RuntimeError((proc.stderr or proc.stdout).strip().splitlines()[-1][:500])
    return proc.stdout.strip().splitlines()[-1]


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    return [[3 + (17 * i + 31 * j) % (vocab - 3) for j in range(length)] for i in range(n)]


def _ortpa_engine(converted: Path, threads: int = THREADS, spinning: bool | None = None):
    """The Engine on ``threads`` intra-op threads; ``spinning``: None keeps ONNX Runtime's default (spinning, as
    genai runs), True / False sets ``session.intra_op.allow_spinning``."""
    import onnxruntime as ort

    from ortpa.runtime.engine import Engine

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    if spinning is not None:
        opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if spinning else "0")
    return Engine(
        converted,
        num_blocks=512,
        block_size=16,
        providers=["CPUExecutionProvider"],
        sess_options=opts,
        enable_prefix_caching=False,
    )


# Runs in this python, a fresh process per round as genai's rounds are: the Engine, a one-prompt warm-up, then the
# timed generation; prints JSON {wall, cpu} (tokens per wall / CPU second).
_ORTPA_GENERATE = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    sys.path.insert(0, {bench_dir!r})
    import vs_genai
    engine = vs_genai._ortpa_engine(Path({model!r}), {threads}, spinning={spinning})
    wall, cpu = vs_genai._ortpa_round(engine, json.loads({prompts!r}), {new_tokens})
    print(json.dumps({{"wall": wall, "cpu": cpu}}))
    """
)


def _ortpa_process_round(model: Path, prompts, new_tokens: int, threads: int, spinning, cpus) -> tuple[float, float]:
    """One round of the Engine in a fresh process (see the module docstring: both sides alike)."""
    code = _ORTPA_GENERATE.format(bench_dir=str(Path(__file__).resolve().parent), model=str(model), threads=threads,
                                  spinning=spinning, prompts=json.dumps(prompts), new_tokens=new_tokens)  # fmt: skip
    result = json.loads(_subprocess(sys.executable, code, timeout=1800, cpus=cpus))
    return result["wall"], result["cpu"]


def _ortpa_round(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Generated tokens per wall second and per CPU second of this process, after a one-prompt warm-up."""
    from ortpa.runtime.sampling import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens)
    engine.generate(prompts[:1], params)  # warm-up: first-run allocations and kernel selection
    t, c = time.perf_counter(), time.process_time()
    tokens = sum(len(o) for o in engine.generate(prompts, params))
    return tokens / (time.perf_counter() - t), tokens / (time.process_time() - c)


def run(
    quick: bool = False,
    genai_python: str | None = None,
    *,
    rounds: int = ROUNDS,
    work: str | None = None,
    cpus: list[int] | None = None,
    threads: int = THREADS,
    deep: bool = False,
) -> list[dict]:
    config = DEEP if deep else CONFIG
    genai_python = genai_python or os.environ.get("ORTPA_GENAI_PYTHON")
    prompt_len, new_tokens = (16, 8) if quick else (64, 32)
    params = sum(
        [
            2 * config["vocab_size"] * config["hidden_size"],
            config["num_hidden_layers"]
            * (
                2 * config["hidden_size"] * config["num_attention_heads"] * config["head_dim"]
                + 2 * config["hidden_size"] * config["num_key_value_heads"] * config["head_dim"]
                + 3 * config["hidden_size"] * config["intermediate_size"]
            ),
        ]
    )
    dims = f"genai builder fp32 Llama ~{params / 1e6:.0f}M params; prompts {prompt_len}, {new_tokens} new"
    dims += f"; {threads} threads; CPUs {','.join(map(str, cpus)) if cpus else 'all'}"
    if not genai_python:
        return [
            _row("vs_genai", "throughput_ratio", math.nan, "x", "not available: no --genai-python / ORTPA_GENAI_PYTHON")
        ]
    if cpus:
        os.sched_setaffinity(0, cpus)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ortpa_vs_genai_") as tmp:
        base = Path(work) if work else Path(tmp)
        base.mkdir(parents=True, exist_ok=True)
        hf, out = str(base / "hf"), str(base / "genai")
        if not (Path(out) / "model.onnx").exists():
            try:
                _build(genai_python, hf, out, config)
            except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
                return [_row("vs_genai", "throughput_ratio", math.nan, "x", f"not available: {str(exc)[-300:]}")]
        _genai_options(Path(out), threads)
        converted = base / "paged" / "model.onnx"
        from ortpa import OrtpaError, convert_file

        try:
            if not converted.exists():
                convert_file(Path(out) / "model.onnx", converted)
        except OrtpaError as exc:  # the recogniser's (or the verification's) reason, reported instead of a crash
            reason = str(exc).splitlines()[0][:300]
            return [_row("vs_genai", "throughput_ratio", math.nan, "x", f"conversion not available: {reason}")]
        import onnxruntime as ort

        engine = _ortpa_engine(converted, threads)  # the host rows; the rounds run in processes of their own
        from ortpa.bench._timing import decode_host_share

        for n in (1, 16):  # the driver loop's share of a decode step (issue 39: < 10% at one request)
            h = decode_host_share(engine, _prompts(n, prompt_len, config["vocab_size"]), max(new_tokens, 32))
            goal = "; target < 10%" if n == 1 else ""
            rows.append(_row(f"vs_genai.host.{n}", "host_share", round(100.0 * h.share, 1), "%",
                             f"ortpa Engine, {n} request(s) decoding on {dims}: time outside ONNX Runtime's run over "
                             f"step time, {h.steps} steps (median step {h.step_ms:.2f} ms, host {h.host_us:.0f} us)"
                             f"{goal}"))  # fmt: skip
        for n in CONCURRENCY:
            prompts = _prompts(n, prompt_len, config["vocab_size"])
            code = _GENERATE.format(prompts=json.dumps(prompts), new_tokens=new_tokens, threads=threads, model_dir=out)
            genai, ours, genai_cpu, ours_cpu, versions, slept = [], [], [], [], "", []
            load = os.getloadavg()[0]
            # alternate the two round by round: a burst of load from other processes hits both alike
            for _ in range(rounds):
                result = json.loads(_subprocess(genai_python, code, timeout=1800, cpus=cpus))
                genai.append(result["tokens"] / result["seconds"])
                genai_cpu.append(result["tokens"] / result["cpu_seconds"])
                versions = f"genai {result['genai']} on ORT {result['ort']}; ortpa on ORT {ort.__version__}"
                wall, cpu = _ortpa_process_round(converted, prompts, new_tokens, threads, None, cpus)
                ours.append(wall)
                ours_cpu.append(cpu)
                if n in NOSPIN_ROWS:
                    slept.append(_ortpa_process_round(converted, prompts, new_tokens, threads, False, cpus)[0])
            load = f"load average {load:.1f} -> {os.getloadavg()[0]:.1f}"
            notes = f"{dims}; median of {rounds}, alternated; {versions}; {load}"
            g, o = statistics.median(genai), statistics.median(ours)
            rows.append(_row(f"vs_genai.genai.{n}", "throughput", round(g, 1), "tokens/s", notes))
            rows.append(_row(f"vs_genai.ortpa.{n}", "throughput", round(o, 1), "tokens/s", notes))
            # per CPU second of each side's process: what the neighbours' load disturbs least (read it at 1 thread)
            cpu_ratio = statistics.median(ours_cpu) / statistics.median(genai_cpu)
            rows.append(_row(f"vs_genai.{n}.cpu", "throughput_ratio", round(cpu_ratio, 2), "x",
                             f"ortpa / genai tokens per CPU second, medians (genai {statistics.median(genai_cpu):.1f}, "
                             f"ortpa {statistics.median(ours_cpu):.1f}); {load}"))  # fmt: skip
            ratio = o / g
            goal = TARGETS.get(n)
            verdict = f"; target >= {goal}: {ratio >= goal}" if goal else ""
            spread = f"; per-round ratios {min(ours) / max(genai):.2f}-{max(ours) / min(genai):.2f}"
            rows.append(_row(f"vs_genai.{n}", "throughput_ratio", round(ratio, 2), "x",
                             f"ortpa / genai, medians{verdict}{spread}; {load}"))  # fmt: skip
            if slept:
                rows.append(_row(f"vs_genai.{n}.nospin", "throughput_ratio", round(statistics.median(slept) / g, 2),
                                 "x", f"ortpa with its CPU pool not spinning (session.intra_op.allow_spinning=0) / "
                                 f"genai, medians, same rounds; {load}"))  # fmt: skip
        rows += _release_rows(genai_python, Path(out) / "model.onnx", config, threads, rounds, cpus, dims)
    return rows


def main(argv: list[str] | None = None) -> int:
    from ortpa.bench import format_table

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--genai-python", default=None, help="python of a venv with onnxruntime-genai (and torch, transformers)"
    )
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--rounds", type=int, default=ROUNDS, help="rounds per side (alternated; rows are medians)")
    ap.add_argument("--work", default=None, help="keep the built and converted models here and reuse them")
    ap.add_argument("--cpus", default=None, help="CPUs both sides run on, e.g. 0,1 (default: all)")
    ap.add_argument("--threads", type=int, default=THREADS, help="intra-op threads of each side")
    ap.add_argument("--deep", action="store_true", help="a 30-layer SmolLM-135M-shaped Llama instead of 8 layers")
    args = ap.parse_args(argv)
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
    rows = run(
        quick=args.quick,
        genai_python=args.genai_python,
        rounds=args.rounds,
        work=args.work,
        cpus=cpus,
        threads=args.threads,
        deep=args.deep,
    )
    print(json.dumps(rows, indent=1) if args.json else format_table(rows))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
