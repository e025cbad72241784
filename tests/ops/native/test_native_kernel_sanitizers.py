"""The native kernel under AddressSanitizer and UndefinedBehaviorSanitizer.

ASan inside a Python process needs its runtime preloaded (LD_PRELOAD) ahead of the interpreter; instead the
kernel's sources are compiled with ``-fsanitize=address,undefined -fno-sanitize-recover=all`` together with a
standalone C++ fuzz driver (fuzz_driver.cc): thousands of random calls, valid and hostile (any int32 in the
index inputs, disagreeing shapes, every layout and cache type, both threading modes), each tensor its own
exactly-sized heap block. Any read or write out of bounds, any undefined behaviour, aborts the driver.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from kernel_build import compile_kernel

HERE = Path(__file__).resolve().parent


def run(exe: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=120, check=False)


def test_fuzz_driver_clean_under_asan_and_ubsan(tmp_path) -> None:
    exe = compile_kernel(tmp_path / "fuzz_driver", extra_sources=(HERE / "fuzz_driver.cc",), sanitize=True)
    done = run(exe, "3000", "20261205")
    assert done.returncode == 0, done.stderr[-4000:]
    m = re.search(r"calls (\d+) ok (\d+) refused (\d+)", done.stdout)
    assert m, done.stdout
    calls, ok, refused = map(int, m.groups())
    # both outcomes are exercised in quantity: the hostile inputs reach the compute, not only the checks
    assert calls == 3000 and ok > 600 and refused > 600, done.stdout


def test_sanitizer_build_catches_an_overflow(tmp_path) -> None:
    """The same flags stop a program on a one-element heap overflow: the check above can fail."""
    src = tmp_path / "overflow.cc"
    src.write_text(
        "#include <cstdlib>\n"
        "int main(int argc, char**) {\n"
        "  int* p = static_cast<int*>(std::calloc(4, sizeof(int)));\n"
        "  int v = p[3 + argc];\n"
        "  std::free(p);\n"
        "  return v == 12345;\n"
        "}\n"
    )
    exe = compile_kernel(tmp_path / "overflow", extra_sources=(src,), sanitize=True, with_kernel=False)
    done = run(exe)
    # UBSan's object-size check or ASan's heap-buffer-overflow, whichever sees it first
    assert done.returncode != 0 and ("runtime error" in done.stderr or "heap-buffer-overflow" in done.stderr)
