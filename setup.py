"""The package's one compiled part: ortpa's native PagedAttention custom-op library (docs/native.md).

Every ``.cc`` under ``ortpa/ops/native/`` becomes one shared library inside the package, loaded by ONNX Runtime
(``SessionOptions.register_custom_ops_library``), never imported by Python. The extension is optional: where it
cannot be built (no C++ compiler) the package still installs and ortpa runs PagedAttention through its portable
lowering, saying so once. Baseline ISA only (no ``-march=native``): the library must run on any machine the wheel
lands on; the kernel picks wider vector units at run time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

NATIVE = Path("ortpa/ops/native")


class BuildNative(build_ext):
    """C++17 flags per compiler, the sources compiled on every core, and no Python module init symbol to export
    (ONNX Runtime looks up ``RegisterCustomOps``)."""

    def finalize_options(self) -> None:
        super().finalize_options()
        if not self.parallel:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self) -> None:
        if self.compiler.compiler_type == "msvc":
            flags = ["/std:c++17", "/O2", "/W4", "/EHsc"]
        else:
            flags = ["-std=c++17", "-O3", "-g0", "-Wall", "-Wextra", "-fvisibility=hidden", "-fno-math-errno"]
        for ext in self.extensions:
            ext.extra_compile_args = flags + list(ext.extra_compile_args)
        super().build_extensions()

    def get_export_symbols(self, ext: Extension) -> list[str]:
        return ["RegisterCustomOps"]


def _sources() -> list[str]:
    return sorted(p.as_posix() for p in NATIVE.rglob("*.cc"))


setup(
    ext_modules=[
        Extension(
            "ortpa.ops.native._ortpa_native",
            sources=_sources(),
            depends=sorted(p.as_posix() for p in NATIVE.rglob("*") if p.suffix in (".h", ".inc")),
            include_dirs=[str(NATIVE)],
            language="c++",
            optional=True,  # a failed build is a warning: the package installs without it (docs/native.md)
            extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
        )
    ],
    cmdclass={"build_ext": BuildNative},
)
