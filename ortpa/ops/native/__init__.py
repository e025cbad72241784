"""ortpa's native CPU PagedAttention: finding, checking and describing the custom-op library the package builds.

The C++ sources beside this file compile into one shared library (``setup.py``), which ONNX Runtime loads with
``SessionOptions.register_custom_ops_library``. Python never imports it; this module only finds it, reads what
it reports (ISA path, the ONNX Runtime API version it asks for), and decides which path PagedAttention nodes take
on the CPU execution provider (:func:`paged_attention_mode`). docs/native.md describes the build, the ABI
declaration and the fallback.
"""

from ortpa.ops.native.library import (
    ENV_LIBRARY,
    ENV_MODE,
    MODES,
    NATIVE_BACKEND,
    NativeLibrary,
    absent_reason,
    find_library,
    native_library,
    native_report,
    paged_attention_mode,
    register_native,
    reset_native_library,
    warn_if_absent,
)

__all__ = [
    "ENV_LIBRARY",
    "ENV_MODE",
    "MODES",
    "NATIVE_BACKEND",
    "NativeLibrary",
    "absent_reason",
    "find_library",
    "native_library",
    "native_report",
    "paged_attention_mode",
    "register_native",
    "reset_native_library",
    "warn_if_absent",
]
