"""The one vocabulary of ONNX Runtime execution-provider names: the providers ortpa knows, the short names the CLI
and the demo accept, the device each puts its OrtValues on.

Which backend of the op each provider runs is the op's business (:func:`ortpa.ops.backends.backend_for_provider`);
whether CUDA can run on this machine is the runtime's (:mod:`ortpa.runtime.device`).
"""

from __future__ import annotations

__all__ = ["CPU", "CUDA", "DEVICE_OF", "PROVIDER_NAMES", "WEBGPU", "providers_for"]

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
WEBGPU = "WebGpuExecutionProvider"

# The short device names the CLI and the demo accept, and the execution provider each stands for.
PROVIDER_NAMES: dict[str, str] = {"cpu": CPU, "cuda": CUDA}

# The OrtValue device type of a provider's tensors (what IO binding allocates the caches on).
DEVICE_OF: dict[str, str] = {CUDA: "cuda", CPU: "cpu"}


def providers_for(name: str) -> list[str]:
    """The provider list for a short name (``"cpu"``, ``"cuda"``) or a provider name: it, then CPU as fallback."""
    provider = PROVIDER_NAMES.get(name.lower(), name)
    return list(dict.fromkeys([provider, CPU]))
