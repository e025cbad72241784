"""Compile the native kernel's sources (``ortpa/ops/native/kernel/*.cc``) with g++ for the tests.

The tests call the kernel directly through ctypes, so they build it themselves from the checkout's sources,
optionally with a driver and sanitizer flags (test_kernel_sanitizers.py): what they test is exactly these
sources, whatever the package build did.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import ortpa

__all__ = ["KERNEL_DIR", "compile_kernel"]

KERNEL_DIR = Path(ortpa.__file__).resolve().parent / "ops" / "native" / "kernel"
SANITIZE = ["-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def compile_kernel(
    out: Path, *, extra_sources: tuple[Path, ...] = (), sanitize: bool = False, with_kernel: bool = True
) -> Path:
    """Build a shared library (no extra sources) or an executable (a driver among extra_sources) at ``out``;
    ``with_kernel=False`` builds the extra sources alone with the same flags."""
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("compile the native kernel: expected g++ or c++ on PATH, found neither")
    sources = sorted(str(p) for p in KERNEL_DIR.glob("*.cc")) if with_kernel else []
    sources += [str(p) for p in extra_sources]
    flags = ["-std=c++17", "-Wall", "-Wextra", "-Werror", "-pthread", f"-I{KERNEL_DIR}"]
    flags += SANITIZE if sanitize else ["-O2"]
    if not extra_sources:
        flags += ["-shared", "-fPIC"]
    cmd = [cxx, *flags, *sources, "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"compile the native kernel: {' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return out
