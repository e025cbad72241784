"""The native kernel, compiled once per test session (per xdist worker) from the checkout's sources."""

from __future__ import annotations

import pytest
from kernel_build import compile_kernel

from ortpa.ops.native.kernel import KernelLibrary


@pytest.fixture(scope="session")
def kernel(tmp_path_factory) -> KernelLibrary:
    return KernelLibrary(compile_kernel(tmp_path_factory.mktemp("native") / "libortpa_kernel.so"))
