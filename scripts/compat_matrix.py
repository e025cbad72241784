"""Run ``--portable`` files on every listed ONNX Runtime release, in Node.js and on the OpenVINO EP (issue 40).

    python scripts/compat_matrix.py [--venvs DIR] [--work DIR] [--json OUT]

For each release a venv ``DIR/ort-<release>`` (created with ``pip install onnxruntime==<release> numpy`` when
missing; pip caches the wheels, so only the first run needs the package index) runs, with no ortpa:

* ``examples/portable_greedy.py`` (the loop of ``docs/converted_model.md``) over the ``--portable`` files of a
  GQA and an MLA fixture, each in the default and the ``--if-free`` form: its tokens must equal ortpa's own
  ``Engine.generate`` on the same file;
* one-node lowered PagedAttention models over every kind of step (prompt chunks only, ragged decodes, both,
  no token at all, an invalid sequence, an unmapped page; GQA through the fused decode and LATENT through the
  standard ops; both forms): outputs within the float16 tolerance of ortpa's NumPy oracle.

A release below the files' ``ortpa.portable.min_onnxruntime`` (``--below``) must refuse them with a message
(exit status 1), never crash. ``--node-dir`` (onnxruntime-node installed there, ``npm install --ignore-scripts``)
runs ``examples/node/greedy.js``; ``--openvino`` runs the loop on onnxruntime-openvino's OpenVINO EP: the
``--if-free`` files must give ortpa's tokens, the default files (whose ``If`` branches OpenVINO refuses) are
reported; each run says which kernels the OpenVINO EP took (docs/portable.md). Exit status 0 when every judged
row holds. The machine needs the package index only to create missing venvs or the npm folder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's ortpa (the driver's side only)
RELEASES = ("1.20.1", "1.22.1", "1.24.4", "1.26.0", "1.28.0", "1.30.0", "1.32.0")
BELOW = "1.19.2"  # the newest release before the floor (ortpa.deploy.portable_file.MIN_ONNXRUNTIME)
OPENVINO = "1.24.1"  # onnxruntime-openvino
NODE = "1.31.1"  # onnxruntime-node
MODELS = {"gqa": "llama_sdpa_op18", "mla": "dsv3_sdpa_op18"}  # default-domain opset 18: every listed release
# each fixture in both portable forms: the default (If-skipped groups) and --if-free (what the OpenVINO EP compiles)
FORMS = {"": False, "_if_free": True}
PROMPTS = [[1, 2, 3], list(range(7, 27))]  # ragged: a prefill step of two lengths, then ragged decodes
NEW_TOKENS = 8
# (q_lens, pasts, unmapped page of sequence 0) of each step kind the one-node cases run
STEPS = {
    "prefills_only": ((4, 6), (0, 3), None),
    "decodes_ragged": ((1, 1, 1), (3, 18, 40), None),
    "mixed": ((5, 1, 1), (0, 12, 33), None),
    "zero_tokens": ((0,), (5,), None),
    "invalid_sequence": ((1, 3), (10_000, 4), None),
    "unmapped_page": ((1, 1), (40, 9), 1),
}


# ---------------------------------------------------------------------------------------------- in each venv
def run_cases(folder: Path) -> int:
    """(In a release's venv: numpy and onnxruntime only.) Each case's outputs against the oracle's."""
    import numpy as np
    import onnxruntime as ort

    spec = json.loads((folder / "cases.json").read_text())
    bad = []
    for name in spec["cases"]:
        data = dict(np.load(folder / f"{name}.npz"))
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(str(folder / f"{name}.onnx"), so, providers=["CPUExecutionProvider"])
        feeds = {i.name: data[i.name] for i in sess.get_inputs()}
        try:
            got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
        except Exception as exc:  # an error is a failed case; a crash ends the process (a negative status)
            bad.append(f"{name}: {' '.join(str(exc).split())[:300]}")
            continue
        for out in ("output", "key_cache_out", "value_cache_out"):
            if out not in got:
                continue
            a, e = got[out].astype(np.float32), data[f"expected.{out}"].astype(np.float32)
            if a.shape != e.shape or not np.allclose(a, e, rtol=spec["rtol"], atol=spec["atol"]):
                err = float(np.abs(a - e).max()) if a.shape == e.shape else f"shape {a.shape} != {e.shape}"
                bad.append(f"{name}:{out} max|d|={err}")
    print(json.dumps({"cases": len(spec["cases"]), "failed": bad}))
    return 1 if bad else 0


# ---------------------------------------------------------------------------------------------- the driver
def make_cases(folder: Path) -> list[str]:
    """One-node lowered models and the oracle's outputs for them (float16, block size 16)."""
    import numpy as np

    from ortpa.ops.oracle import paged_attention
    from ortpa.ops.portable import lower_to_portable, paged_attention_model
    from ortpa.ops.spec import PAGED_ATTENTION
    from ortpa.tolerances import tol_for

    folder.mkdir(parents=True, exist_ok=True)
    names = []
    layouts = {
        "gqa": (32, dict(num_heads=8, kv_num_heads=2)),  # fused decode (MultiHeadAttention)
        "latent": (48, dict(num_heads=4, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=32)),
    }
    for layout, (h, attrs), (suffix, if_free) in (
        (layout, spec, form) for layout, spec in layouts.items() for form in FORMS.items()
    ):
        for step, (q_lens, pasts, unmapped) in STEPS.items():
            rng = np.random.default_rng(len(names))
            n, kvh = attrs["num_heads"], attrs["kv_num_heads"]
            bs, t, latent = 16, sum(q_lens), layout == "latent"
            per_seq = max(-(-(p + q) // bs) for p, q in zip(pasts, q_lens, strict=True) if p < 10_000) + 1
            blocks = rng.permutation(len(q_lens) * per_seq).astype(np.int32).reshape(len(q_lens), per_seq)
            if unmapped is not None:
                blocks[0, unmapped] = -1
            x = {
                "query": rng.standard_normal((t, n * h)).astype(np.float16),
                "key": rng.standard_normal((t, h if latent else kvh * h)).astype(np.float16),
                "key_cache": rng.standard_normal((blocks.size, bs, kvh, h)).astype(np.float16),
                "cumulative_sequence_length": np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                "past_seqlens": np.array(pasts, np.int32),
                "block_table": blocks,
            }
            if not latent:
                x["value"] = rng.standard_normal((t, kvh * h)).astype(np.float16)
                x["value_cache"] = rng.standard_normal((blocks.size, bs, kvh, h)).astype(np.float16)
            a = dict(attrs, scale=float(1 / np.sqrt(h)))
            model = lower_to_portable(paged_attention_model(x, a), if_free=if_free)
            out, k_out, v_out = paged_attention(**{f: x.get(f) for f in PAGED_ATTENTION.input_names}, **a)
            name = f"{layout}{suffix}_{step}"
            (folder / f"{name}.onnx").write_bytes(model.SerializeToString())
            expected = {"expected.output": out, "expected.key_cache_out": k_out}
            if v_out is not None:
                expected["expected.value_cache_out"] = v_out
            np.savez(folder / f"{name}.npz", **x, **expected)
            names.append(name)
    rtol, atol = tol_for(np.float16)
    (folder / "cases.json").write_text(json.dumps({"cases": names, "rtol": rtol, "atol": atol}))
    return names


def convert_models(work: Path) -> dict[str, tuple[Path, list[list[int]]]]:
    """The ``--portable`` files and ortpa's own tokens on each."""
    import ortpa
    from ortpa.runtime.engine import Engine
    from ortpa.runtime.sampling import SamplingParams

    models = {}
    for key, fixture in MODELS.items():
        for suffix, if_free in FORMS.items():
            out = work / f"{key}{suffix}" / "model.onnx"
            if not out.exists():
                src = ROOT / "tests" / "fixtures" / f"{fixture}.onnx"
                ortpa.convert_file(src, out, portable=True, if_free=if_free)
            tokens = Engine(out, num_blocks=16).generate(PROMPTS, SamplingParams(max_new_tokens=NEW_TOKENS))
            models[f"{key}{suffix}"] = (out, tokens)
    return models


def venv(folder: Path, requirement: str) -> Path:
    """A venv with ``requirement`` and numpy (created when missing); its python."""
    python = folder / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
        subprocess.run([str(folder / "bin" / "pip"), "install", "-q", requirement, "numpy"], check=True)
    return python


def loop_args(path: Path) -> list[str]:
    args = [str(ROOT / "examples" / "portable_greedy.py"), str(path), "--max-new-tokens", str(NEW_TOKENS)]
    for p in PROMPTS:
        args += ["--prompt-ids", ",".join(map(str, p))]
    return args


def run(cmd: list[str], env: dict | None = None) -> tuple[int, str, str]:
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    return done.returncode, done.stdout, done.stderr


def tokens_row(rc: int, out: str, err: str, want: list[list[int]]) -> dict:
    if rc != 0:  # a negative status is a signal: the crash this matrix exists to catch
        return {"ok": False, "status": rc, "error": (err.strip().splitlines() or [""])[-1][:300]}
    last = json.loads(out.strip().splitlines()[-1])
    return {"ok": last["outputs"] == want, "status": rc, "tokens": last["outputs"], **_placement(last)}


def _placement(result: dict) -> dict:
    return {"placement": result["placement"]} if "placement" in result else {}


def _cell(c: dict | None) -> str:
    if c is None:
        return "—"
    return "ok" if c["ok"] else f"FAIL ({c.get('status')}: {c.get('error') or c.get('failed')})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venvs", type=Path, default=Path(os.environ.get("ORTPA_COMPAT_VENVS", "/tmp/ortpa-compat")))
    ap.add_argument("--work", type=Path, default=None, help="where the files are written (default: VENVS/work)")
    ap.add_argument("--releases", nargs="*", default=list(RELEASES))
    ap.add_argument("--below", default=BELOW, help="a release below the floor, which must refuse ('' to skip)")
    ap.add_argument("--openvino", default=OPENVINO, help="onnxruntime-openvino release ('' to skip)")
    ap.add_argument("--node-dir", type=Path, default=None, help="folder for onnxruntime-node (default: VENVS/node)")
    ap.add_argument("--no-node", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--run-cases", type=Path, help=argparse.SUPPRESS)  # inside a release's venv
    args = ap.parse_args(argv)
    if args.run_cases:
        return run_cases(args.run_cases)

    start = time.perf_counter()
    work = args.work or args.venvs / "work"
    models = convert_models(work)
    cases = make_cases(work / "cases")
    rows: list[dict] = []
    for release in args.releases:
        t0 = time.perf_counter()
        python = venv(args.venvs / f"ort-{release}", f"onnxruntime=={release}")
        row = {"runtime": f"onnxruntime {release}", "judged": True}
        for key, (path, want) in models.items():
            row[key] = tokens_row(*run([str(python), *loop_args(path)]), want)
        rc, out, err = run([str(python), __file__, "--run-cases", str(work / "cases")])
        row["cases"] = {"ok": rc == 0, "status": rc, **(json.loads(out) if rc in (0, 1) and out else {"error": err})}
        row["ok"] = all(row[k]["ok"] for k in (*models, "cases"))
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
    if args.below:
        python = venv(args.venvs / f"ort-{args.below}", f"onnxruntime=={args.below}")
        row = {"runtime": f"onnxruntime {args.below} (below the floor: must refuse)", "judged": True}
        for key, (path, _) in models.items():
            rc, _, err = run([str(python), *loop_args(path)])
            row[key] = {"ok": rc == 1 and "needs onnxruntime >=" in err, "status": rc, "error": err.strip()[-200:]}
        row["ok"] = all(row[k]["ok"] for k in models)
        rows.append(row)
    if not args.no_node:
        node_dir = args.node_dir or args.venvs / "node"
        if not (node_dir / "node_modules" / "onnxruntime-node").exists():
            node_dir.mkdir(parents=True, exist_ok=True)
            subprocess.run(
                [
                    "npm",
                    "install",
                    "--ignore-scripts",
                    "--no-save",
                    "--prefix",
                    str(node_dir),
                    f"onnxruntime-node@{NODE}",
                ],
                check=True,
                capture_output=True,
            )
        env = {**os.environ, "NODE_PATH": str(node_dir / "node_modules")}
        row = {"runtime": f"onnxruntime-node {NODE} (Node.js {run(['node', '--version'])[1].strip()})", "judged": True}
        for key, (path, want) in models.items():
            cmd = [
                "node",
                str(ROOT / "examples" / "node" / "greedy.js"),
                str(path),
                "--max-new-tokens",
                str(NEW_TOKENS),
            ]
            row[key] = tokens_row(*run(cmd + [",".join(map(str, p)) for p in PROMPTS], env), want)
        row["ok"] = all(row[k]["ok"] for k in models)
        rows.append(row)
    if args.openvino:
        # judged on the If-free files; the default files are reported (OpenVINO refuses their If branches)
        python = venv(args.venvs / "openvino", f"onnxruntime-openvino=={args.openvino}")
        row = {"runtime": f"onnxruntime-openvino {args.openvino}, OpenVINO EP", "judged": True}
        providers = ["--provider", "OpenVINOExecutionProvider", "--provider", "CPUExecutionProvider"]
        for key, (path, want) in models.items():
            row[key] = tokens_row(*run([str(python), *loop_args(path), *providers, "--placement"]), want)
            row[key]["judged"] = key.endswith("_if_free")
        row["ok"] = all(row[k]["ok"] for k in models if k.endswith("_if_free"))
        rows.append(row)

    total = round(time.perf_counter() - start, 1)
    heads = " | ".join(f"{k} tokens" for k in models)
    print(f"| runtime | {heads} | one-node cases ({len(cases)}) | seconds |")
    print("|---|" + "---|" * (len(models) + 2))
    for r in rows:
        cells = [_cell(r.get(k)) for k in (*models, "cases")]
        print(f"| {r['runtime']} | {' | '.join(cells)} | {r.get('seconds', '')} |")
    for r in rows:
        for k in models:
            if isinstance(r.get(k), dict) and "placement" in r[k]:
                print(f"{r['runtime']}, {k}: {r[k]['placement']}")
    print(f"total {total} s")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "seconds": total}, indent=1))
    return 0 if all(r["ok"] for r in rows if r["judged"]) else 1


if __name__ == "__main__":
    sys.exit(main())
