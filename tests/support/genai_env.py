"""onnxruntime-genai's Python, for tests that drive genai's Engine in a subprocess (it cannot share ortpa's env).

``ORTPA_GENAI_PYTHON`` names it (``.ci/run`` makes that venv and exports it). When it is unset the venv is made
here, once, at ``ORTPA_GENAI_VENV`` (default ``/tmp/ortpa-genai-venv``, the path ``.ci/run`` uses) with
``pip install "onnxruntime-genai==0.18.*"`` (network, about a minute), so README's test command works as written.
Parallel workers (pytest-xdist) take a file lock beside the venv: one makes it, the others wait and use it.
Anything that goes wrong is a test failure naming the cause, never a skip.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["GENAI_REQUIREMENT", "find_genai_python", "run_genai_driver"]

GENAI_REQUIREMENT = "onnxruntime-genai==0.18.*"
DRIVER = Path(__file__).resolve().parents[2] / "ortpa" / "deploy" / "genai_driver.py"


def _imports_genai(python: str) -> str | None:
    """None when ``python`` imports onnxruntime_genai; else why not."""
    try:
        proc = subprocess.run(
            [python, "-c", "import onnxruntime_genai"], capture_output=True, text=True, timeout=120, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return str(exc)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["exit status nonzero"])[-1]


def find_genai_python() -> str:
    python = os.environ.get("ORTPA_GENAI_PYTHON")
    if python:
        problem = _imports_genai(python)
        if problem:
            pytest.fail(f"ORTPA_GENAI_PYTHON={python} cannot import onnxruntime_genai: {problem}")
        return python
    venv = Path(os.environ.get("ORTPA_GENAI_VENV", "/tmp/ortpa-genai-venv"))
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, made or failed
        return _made_genai_venv(venv)


def _made_genai_venv(venv: Path) -> str:
    python = str(venv / "bin" / "python")
    if Path(python).is_file() and _imports_genai(python) is None:
        return python
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [python, "-m", "pip", "install", "--quiet", GENAI_REQUIREMENT],
    ]
    for cmd in steps:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            pytest.fail(f"making onnxruntime-genai's venv ({' '.join(cmd)}) failed: {exc}; set ORTPA_GENAI_PYTHON")
        if proc.returncode != 0:
            tail = " ".join(proc.stderr.split())[-600:]
            pytest.fail(f"making onnxruntime-genai's venv ({' '.join(cmd)}) failed: {tail}; set ORTPA_GENAI_PYTHON")
    problem = _imports_genai(python)
    if problem:
        pytest.fail(f"the venv made at {venv} cannot import onnxruntime_genai: {problem}")
    return python


def run_genai_driver(python: str, request: dict, timeout: float = 600) -> dict:
    """ortpa/deploy/genai_driver.py in genai's Python: its JSON result (genai's own error message on failure)."""
    proc = subprocess.run(
        [python, str(DRIVER)], input=json.dumps(request), capture_output=True, text=True, timeout=timeout, check=False
    )
    try:
        result = json.loads(proc.stdout)
    except ValueError:
        raise AssertionError(f"genai driver exit {proc.returncode}: {proc.stderr[-2000:]}") from None
    if "error" in result:
        raise AssertionError(f"onnxruntime-genai refused {request['folder']}: {result['error']}")
    return result
