"""ortpa's native CPU kernel of ``com.microsoft::PagedAttention`` (C++17 sources) and its ctypes binding.

The sources (``paged_attention.h``, the C interface; ``*.cc``) are compiled into the package's custom-op
library by the package build; :mod:`.binding` calls the kernel directly through ctypes (tests, benchmarks),
without ONNX Runtime.
"""

from ortpa.ops.native.kernel.binding import KernelLibrary

__all__ = ["KernelLibrary"]
