"""``ortpa convert HF_DIR`` against onnxruntime-genai's model builder on the same checkpoint (issue 37).

The checkpoint is SmolLM-135M's architecture (Llama: 30 layers, hidden 576, 9 heads over 3 KV heads, intermediate
1536, vocabulary 49152, tied embeddings) with random bfloat16 weights and a word-level tokenizer, written here (no
download; a trained checkpoint of the same shape traces, streams and rewrites alike: nothing here reads a
weight's value except verification). Timed side by side in one run, each in its own process, best of
``repeats``:

* ``builder``: ``python -m onnxruntime_genai.models.builder -i CKPT -o OUT -p fp32 -e cpu`` run by the interpreter
  ``ORTPA_GENAI_BUILDER_PYTHON`` names (one with onnxruntime-genai, torch and transformers: genai's own venv,
  ``pip install "onnxruntime-genai==0.18.*" torch==2.13.0 transformers``); it verifies nothing;
* ``export_rewrite``: ``ortpa convert CKPT OUT --no-verify`` (export, rewrite, write, check);
* ``convert``: ``ortpa convert CKPT OUT`` (verification included);
* ``export_rewrite_every_layer``: ``--no-verify --trace-every-layer`` (the trace before ``ortpa.export.repeat``).

Rows ``export_vs_builder/<row>``: ``seconds`` and ``over_builder`` (targets: export + rewrite <= 2x the builder, the
whole conversion <= 4x). Without ``ORTPA_GENAI_BUILDER_PYTHON`` the ortpa rows are still measured and the ratio rows
say why they are missing.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ortpa.bench._timing import row as _row

__all__ = ["SMOLLM_135M", "run"]

EXTRAS = ("export",)
SMOLLM_135M = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                   intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30,
                   max_position_embeddings=2048, tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100000.0,
                   bos_token_id=1, eos_token_id=2, pad_token_id=0)  # fmt: skip
_TARGETS = {"export_rewrite": 2.0, "convert": 4.0}
_NO_BUILDER = "no builder: set ORTPA_GENAI_BUILDER_PYTHON to a python with onnxruntime-genai, torch, transformers"


def _checkpoint(folder: Path) -> int:
    from ortpa.testing.checkpoints import write_random_checkpoint
    from ortpa.testing.export_tools import _tokenizer

    config = {k: v for k, v in SMOLLM_135M.items() if k != "architectures"}
    size = write_random_checkpoint(config, folder)
    saved = json.loads((folder / "config.json").read_text())
    saved.update(architectures=SMOLLM_135M["architectures"], bos_token_id=1, eos_token_id=2, pad_token_id=0)
    (folder / "config.json").write_text(json.dumps(saved, indent=1))  # the builder picks its class by architecture
    _tokenizer(SMOLLM_135M["vocab_size"]).save_pretrained(str(folder))  # the builder refuses a folder without one
    return size


def _timed(cmd: list[str], out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {tail}")
    shutil.rmtree(out, ignore_errors=True)
    return seconds


def run(quick: bool = False, repeats: int | None = None) -> list[dict]:
    repeats = repeats or (1 if quick else 2)
    root = Path(tempfile.mkdtemp(prefix="ortpa-bench-builder-"))
    try:
        ckpt = root / "ckpt"
        size = _checkpoint(ckpt)
        note = f"SmolLM-135M shape, 30 layers, {size / 1e9:.2f} GB bfloat16, best of {repeats}"
        main = "from ortpa.cli import entry; entry()"  # what the console script runs
        ortpa = [sys.executable, "-c", main, "convert", str(ckpt), str(root / "o" / "model.onnx"), "--quiet"]
        commands = {
            "export_rewrite": [*ortpa, "--no-verify"],
            "convert": ortpa,
            "export_rewrite_every_layer": [*ortpa, "--no-verify", "--trace-every-layer"],
        }
        builder_python = os.environ.get("ORTPA_GENAI_BUILDER_PYTHON")
        if builder_python:
            builder = [builder_python, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(root / "o")]
            commands["builder"] = [*builder, "-p", "fp32", "-e", "cpu", "-c", str(root / "cache")]
        best: dict[str, float] = {}
        for _ in range(repeats):  # alternated, so that a burst of load on the machine hits every command
            for name, cmd in commands.items():
                seconds = _timed(cmd, root / "o")
                best[name] = min(best.get(name, seconds), seconds)
        rows = [_row(f"export_vs_builder/{n}", "seconds", s, "s", note) for n, s in best.items()]
        for name, target in (*_TARGETS.items(), ("export_rewrite_every_layer", None)):
            if "builder" not in best:
                rows.append(_row(f"export_vs_builder/{name}", "over_builder", 0, "x", _NO_BUILDER))
                continue
            goal = f"target <= {target:g}x" if target else "before layer copies"
            rows.append(_row(f"export_vs_builder/{name}", "over_builder", best[name] / best["builder"], "x", goal))
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    from ortpa.bench import format_table

    print(format_table(run(quick="--quick" in sys.argv[1:])))
