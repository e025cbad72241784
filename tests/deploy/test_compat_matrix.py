"""The compatibility matrix (``scripts/compat_matrix.py``, issue 40): every listed ONNX Runtime release and
onnxruntime-node run the ``--portable`` files of a GQA and an MLA model (default and ``--if-free`` form) with
ortpa's own tokens, one-node cases of every kind of step agree with the oracle, a release below the files' floor
refuses them with a message, and the OpenVINO EP runs the ``--if-free`` files with ortpa's tokens.

Behind the ``compat`` marker (``ORTPA_COMPAT=1``): it creates a venv per release (and an npm folder) the first
time, which needs the package index; ``ORTPA_COMPAT_VENVS`` says where (default ``/tmp/ortpa-compat``). Measured:
about one minute with the venvs in place (docs/portable.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.compat
def test_every_release_runs_the_portable_files_with_ortpa_tokens(tmp_path) -> None:
    out = tmp_path / "matrix.json"
    cmd = [sys.executable, str(ROOT / "scripts" / "compat_matrix.py"), "--work", str(tmp_path / "work")]
    done = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=3600)
    rows = json.loads(out.read_text())["rows"]
    judged = [r for r in rows if r["judged"]]
    assert done.returncode == 0 and all(r["ok"] for r in judged), done.stdout + done.stderr[-2000:]
    releases = {r["runtime"] for r in judged}
    listed = ("1.20.1", "1.22.1", "1.24.4", "1.26.0", "1.28.0", "1.30.0", "1.32.0")
    assert {f"onnxruntime {v}" for v in listed} <= releases
    assert any(r["runtime"].startswith("onnxruntime-node") for r in judged)
    below = [r for r in judged if "below the floor" in r["runtime"]]
    forms = ("gqa", "mla", "gqa_if_free", "mla_if_free")
    assert below and all(r[k]["status"] == 1 for r in below for k in forms)  # refused, not crashed
    # the OpenVINO EP runs the If-free files with ortpa's tokens, every kernel in its own compiled subgraphs
    (openvino,) = [r for r in judged if "OpenVINO EP" in r["runtime"]]
    for key in ("gqa_if_free", "mla_if_free"):
        assert openvino[key]["ok"], openvino[key]
        assert set(openvino[key]["placement"]) == {"OpenVINOExecutionProvider"}, openvino[key]["placement"]
