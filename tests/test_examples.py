"""The scripts in examples/ run from the repo root with their fixture defaults and print what they promise."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

CASES = {
    "convert_and_run_deepseek.py": ["validation for cuda: ok", "step 0 (prefill, 8 packed tokens)", "sequence b:"],
    "iobinding_by_hand.py": ["data_ptr unchanged over 2 steps", "numpy cache changed in place (6 rows written)"],
    "serve_with_engine.py": ["generate: prompt of", "stream: request", "16 prompt tokens from the prefix cache"],
}


@pytest.mark.parametrize("script", sorted(CASES))
def test_example_runs(script: str) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script)],
        cwd=ROOT,
        # the checkout's ortpa, as the tests import it, whether or not (or whichever) ortpa is installed
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))},
        capture_output=True,
        text=True,
        timeout=900,  # a hang guard only (a script takes seconds): never a speed check on a loaded machine
    )
    assert proc.returncode == 0, f"{script} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    for expected in CASES[script]:
        assert expected in proc.stdout, f"{script}: {expected!r} not in output:\n{proc.stdout}"
