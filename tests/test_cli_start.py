"""A fast start: ``ortpa --version`` / ``--help`` and ``import ortpa`` import no heavy library, and a command
imports its own module only. Structural (what is in ``sys.modules`` in a fresh interpreter), not timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import ortpa
from ortpa.cli._common import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("numpy", "onnx", "onnx_ir", "onnxscript", "onnxruntime", "torch", "transformers", "tqdm", "huggingface_hub")


def _imported_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code`` (which may exit through argparse)."""
    probe = (
        "import sys, json, atexit\n"
        "atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))\n" + code
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    return set(json.loads(done.stderr.strip().splitlines()[-1]))


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_version_and_help_import_no_heavy_module(argv):
    loaded = _imported_after(f"from ortpa.cli import main\nmain({argv!r})")
    assert not loaded & set(HEAVY), sorted(loaded & set(HEAVY))
    assert not [m for m in loaded if m.startswith("ortpa.cli.") and m != "ortpa.cli._common"]


def test_import_ortpa_is_light_and_every_public_name_resolves():
    assert not _imported_after("import ortpa") & set(HEAVY)
    for name in ortpa.__all__:
        assert getattr(ortpa, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        ortpa.nope  # noqa: B018


def test_a_command_imports_its_own_module_only():
    loaded = _imported_after("from ortpa.cli import main\nmain(['generate', '--help'])")
    commands = {f"ortpa.cli.{name}" for name in COMMANDS}
    assert loaded & commands == {"ortpa.cli.generate"}
    assert not loaded & {"ortpa.rewriter", "ortpa.deploy", "ortpa.parity", "ortpa.runtime", "onnxruntime"}


def test_the_console_script_ends_fast_yet_flushes_its_output_and_runs_exit_handlers(tmp_path):
    """``entry`` (the console script) ends the process without the interpreter's module teardown: what a command
    printed into a pipe (block-buffered) still arrives, the exit status is the command's, and the exit handlers
    libraries registered (logging, temporary folders, Ray) still run."""
    marker = tmp_path / "handler-ran"
    probe = (
        "import atexit, pathlib, sys\n"
        f"atexit.register(lambda: pathlib.Path({str(marker)!r}).write_text('yes'))\n"
        "from ortpa.cli import entry\n"
        "print('x' * 100000)\n"  # more than a pipe's buffer: written only when flushed
        "entry()\n"
        "print('after entry')\n"  # never reached: entry ends the process
    )
    dense = ROOT / "tests" / "fixtures" / "dsv3_sdpa_op18.onnx"
    runs = [
        (["convert", str(dense), str(tmp_path / "p.onnx"), "--no-verify"], 0, "wrote "),
        (["convert", str(tmp_path / "missing.onnx"), str(tmp_path / "q.onnx")], 1, ""),
    ]
    for argv, code, said in runs:
        marker.unlink(missing_ok=True)
        done = subprocess.run(
            [sys.executable, "-c", probe, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False
        )
        assert done.returncode == code, done.stderr[-2000:]
        assert done.stdout.startswith("x" * 100000) and "after entry" not in done.stdout
        assert said in done.stdout and marker.read_text() == "yes"
    assert (tmp_path / "p.onnx").is_file() and not (tmp_path / "q.onnx").exists()
