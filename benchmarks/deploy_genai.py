"""Deploying with onnxruntime-genai on CPU: genai's Engine on the ``--portable`` file vs ortpa's Engine on the same
file vs genai's dense Generator on the original, tokens/s at 1 and 16 concurrent requests, in one run.

The original is ``benchmarks/vs_genai.py``'s model (a ~58M-parameter Llama made by onnxruntime-genai's builder at
fp32, ``-e cpu``), built at run time in genai's python (``--genai-python`` or ``ORTPA_GENAI_PYTHON``: a venv with
onnxruntime-genai, onnx-ir, torch 2.13.0 CPU, transformers 5.x). ``ortpa convert --portable`` writes the deployment
folder (``ortpa.convert_file``: lowered file + genai_config.json with ``engine.dynamic_batching``: block_size 16,
max_batch_size 16, max_scheduled_tokens 256, num_blocks from the default 256 MiB budget). The three runs, greedy,
prompts of 64 tokens and 32 new tokens each (``--quick``: 16 and 8), all requests submitted together:

* ``genai_engine``: genai's continuous-batching Engine on the deployment folder (``ortpa/deploy/genai_driver.py``
  in genai's python); the only edit to the folder is the thread count below;
* ``ortpa_engine``: :class:`ortpa.Engine` on the same portable file (same block size, same step budget);
* ``genai_dense``: genai's classic ``Generator`` on the original dense folder (one generator over the batch).

Every run uses 2 intra-op threads; times are wall seconds of generation alone (build, conversion and session
creation excluded; one warm-up request first). Rows say "not available" (value ``nan``) when genai's python is
not given or a step fails (the reason is in the notes).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ortpa.bench._timing import engine_tokens_per_s, row

__all__ = ["run"]

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "ortpa" / "deploy" / "genai_driver.py"
CONCURRENCY = (1, 16)
THREADS = 2


def _vs_genai():
    path = Path(__file__).with_name("vs_genai.py")
    spec = importlib.util.spec_from_file_location("ortpa_bench_vs_genai_shared", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(name: str, value: float, notes: str) -> dict:
    return row(name, "throughput", value, "tokens/s", notes)


def _unavailable(why: str) -> list[dict]:
    return [_row(f"deploy_genai.{kind}.{n}", math.nan, f"not available: {why}") for kind in _KINDS for n in CONCURRENCY]


_KINDS = ("genai_engine", "ortpa_engine", "genai_dense")


def _driver(python: str, request: dict) -> dict:
    proc = subprocess.run(
        [python, str(DRIVER)], input=json.dumps(request), capture_output=True, text=True, timeout=3600, check=False
    )
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        raise RuntimeError(proc.stderr.strip().splitlines()[-1][:300] if proc.stderr.strip() else "no output") from None
    if "error" in result:
        raise RuntimeError(result["error"][:300])
    return result


def _ortpa_engine(model: Path, prompts: list[list[int]], new_tokens: int) -> float:
    import onnxruntime as ort

    from ortpa.runtime.engine import Engine

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    opts.inter_op_num_threads = 1
    engine = Engine(model, block_size=16, max_num_batched_tokens=256, sess_options=opts, enable_prefix_caching=False)
    return engine_tokens_per_s(engine, prompts, new_tokens)


def run(quick: bool = False, genai_python: str | None = None) -> list[dict]:
    genai_python = genai_python or os.environ.get("ORTPA_GENAI_PYTHON")
    if not genai_python:
        return _unavailable("no --genai-python / ORTPA_GENAI_PYTHON")
    vs = _vs_genai()
    prompt_len, new_tokens = (16, 8) if quick else (64, 32)
    notes = f"genai builder fp32 Llama (vs_genai.py's); prompts {prompt_len}, {new_tokens} new; {THREADS} threads"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="ortpa_deploy_genai_") as tmp:
        hf, dense = str(Path(tmp) / "hf"), Path(tmp) / "genai"
        code = vs._BUILD.format(scripts=str(ROOT / "scripts"), cfg=json.dumps(vs.CONFIG), hf=hf, out=str(dense))
        try:
            subprocess.run([genai_python, "-c", code], check=True, capture_output=True, text=True, timeout=1800)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            return _unavailable(f"build failed: {(getattr(exc, 'stderr', '') or str(exc))[-300:]}")
        vs._genai_options(dense)  # genai's threads in its genai_config.json, as vs_genai.py gives them
        deploy = Path(tmp) / "deploy" / "model.onnx"
        try:
            from ortpa.conversion import convert_file
            from ortpa.deploy import GenaiOptions

            convert_file(dense, deploy, portable=True, genai=GenaiOptions(max_batch_size=16))
        except Exception as exc:
            return _unavailable(f"convert --portable failed: {str(exc).splitlines()[0][:300]}")
        vs._genai_options(deploy.parent)
        warm = {"name": "warm", "prompts": vs._prompts(1, prompt_len), "max_new_tokens": new_tokens}
        scenarios = [warm] + [
            {"name": f"n{n}", "prompts": vs._prompts(n, prompt_len), "max_new_tokens": new_tokens} for n in CONCURRENCY
        ]
        measured: dict[str, dict[int, float]] = {k: {} for k in _KINDS}
        try:
            result = _driver(genai_python, {"folder": str(deploy.parent), "scenarios": scenarios})
            for n in CONCURRENCY:
                r = result["scenarios"][f"n{n}"]
                measured["genai_engine"][n] = r["generated"] / r["seconds"]
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            rows += [_row(f"deploy_genai.genai_engine.{n}", math.nan, f"not available: {exc}") for n in CONCURRENCY]
        for n in CONCURRENCY:
            measured["ortpa_engine"][n] = _ortpa_engine(deploy, vs._prompts(n, prompt_len), new_tokens)
            gen = vs._GENERATE.format(
                prompts=json.dumps(vs._prompts(n, prompt_len)), new_tokens=new_tokens, threads=THREADS,
                model_dir=str(dense),
            )  # fmt: skip
            try:
                out = json.loads(vs._subprocess(genai_python, gen, timeout=1800))
                measured["genai_dense"][n] = out["tokens"] / out["seconds"]
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                rows.append(_row(f"deploy_genai.genai_dense.{n}", math.nan, f"not available: {exc}"))
    for kind in _KINDS:
        for n, value in measured[kind].items():
            rows.append(_row(f"deploy_genai.{kind}.{n}", round(value, 1), notes))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--genai-python", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from ortpa.bench import format_table

    print(format_table(run(quick=args.quick, genai_python=args.genai_python)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
