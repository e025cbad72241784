"""Where the native library is, what it reports, and which PagedAttention path a session takes on CPU.

Search order: the path in ``ORTPA_NATIVE_LIBRARY`` (a build of one's own, or a path that does not exist to run as
if the library were absent); the library built into this package's folder (an installed wheel, an editable
install, ``python setup.py build_ext --inplace``); the one the installed ``ortpa`` distribution ships (tests run
from a checkout against ``pip install .``, as CI does).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.metadata
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ortpa.errors import InvalidParameter

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

ENV_LIBRARY = "ORTPA_NATIVE_LIBRARY"
ENV_MODE = "ORTPA_PAGED_ATTENTION"
# auto: native where the library is present and its backend entry accepts the node, portable elsewhere;
# native: the library must be present (a node it cannot run is an error); portable: never the library
MODES = ("auto", "native", "portable")
# the name of the library's backend in ortpa.ops.backends.BACKENDS, and what sessions report for its nodes
NATIVE_BACKEND = "native-cpu"
_STEM = "_ortpa_native"

_log = logging.getLogger("ortpa.native")


@dataclass(frozen=True)
class NativeLibrary:
    """A loadable native library: its path and the vector-unit path its kernel chose on this machine."""

    path: Path
    isa: str


@dataclass(frozen=True)
class _Found:
    library: NativeLibrary | None
    reason: str  # why there is none ("" when there is one)


def _built_names(folder: Path) -> list[Path]:
    return [folder / (_STEM + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES]


def _from_distribution() -> Path | None:
    # Every ortpa distribution on the path: a checkout's own ortpa.egg-info (left by `pip install .` and first on
    # sys.path when tests run from the checkout) lists sources only, so the installed one must be looked at too.
    for dist in importlib.metadata.distributions(name="ortpa"):
        for file in dist.files or []:
            if file.parent.as_posix() == "ortpa/ops/native" and file.name.startswith(_STEM + "."):
                path = Path(str(file.locate()))
                if path.is_file():
                    return path
    return None


def find_library() -> tuple[Path | None, str]:
    """The library's path and where it was found, or None and why there is none."""
    override = os.environ.get(ENV_LIBRARY)
    if override:
        path = Path(override)
        if path.is_file():
            return path, f"{ENV_LIBRARY}={override}"
        return None, f"{ENV_LIBRARY}={override} names no file"
    here = Path(__file__).resolve().parent
    for path in _built_names(here):
        if path.is_file():
            return path, str(here)
    installed = _from_distribution()
    if installed is not None and installed.is_file():
        return installed, "the installed ortpa distribution"
    return None, f"not built: no {_STEM} library in {here} nor in the installed ortpa distribution"


def _isa_of(handle: ctypes.CDLL) -> str:
    report = getattr(handle, "ortpa_native_isa", None)
    if report is None:
        return "unknown"
    report.restype = ctypes.c_char_p
    report.argtypes = []
    return report().decode()


@functools.cache
def _load() -> _Found:
    path, where = find_library()
    if path is None:
        return _Found(None, where)
    try:
        handle = ctypes.CDLL(str(path))
    except OSError as exc:
        return _Found(None, f"{path} does not load: {exc}")
    if not hasattr(handle, "RegisterCustomOps"):
        return _Found(None, f"{path} exports no RegisterCustomOps")
    return _Found(NativeLibrary(path, _isa_of(handle)), "")


def native_library() -> NativeLibrary | None:
    """The native library of this process (looked up once), or None when there is none."""
    return _load().library


def absent_reason() -> str:
    return _load().reason


def reset_native_library() -> None:
    """Look again on the next call (after ``ORTPA_NATIVE_LIBRARY`` changed; tests)."""
    _load.cache_clear()
    _warned.cache_clear()


@functools.cache
def _warned() -> bool:
    _log.warning(
        "ortpa: the native CPU PagedAttention library is not available (%s); PagedAttention nodes run through the "
        "portable lowering on CPU, which is slower. Reinstall ortpa on a machine with a C++17 compiler to build it "
        "(docs/native.md).",
        absent_reason(),
    )
    return True


def warn_if_absent() -> None:
    """Say once per process, as a log warning, that CPU sessions run the portable path for want of the library."""
    if native_library() is None:
        _warned()


def paged_attention_mode(explicit: str | None = None) -> str:
    """The PagedAttention path asked for: ``explicit`` if given, else ``$ORTPA_PAGED_ATTENTION``, else auto."""
    source = "paged_attention" if explicit is not None else ENV_MODE
    mode = explicit if explicit is not None else os.environ.get(ENV_MODE, "auto")
    mode = mode.strip().lower()
    if mode not in MODES:
        raise InvalidParameter("InferenceSession", source, f"one of {', '.join(MODES)}", mode)
    return mode


def register_native(options: Any, library: NativeLibrary) -> None:
    """Register the library's ops with an ``onnxruntime.SessionOptions``."""
    options.register_custom_ops_library(str(library.path))


def native_report() -> dict[str, Any]:
    """What ``ortpa doctor`` prints: whether the library is present, its path and ISA path (or why it is absent),
    and the path PagedAttention nodes take on the CPU provider under the current ``$ORTPA_PAGED_ATTENTION``."""
    library = native_library()
    mode = paged_attention_mode()
    cpu_path = "portable" if library is None or mode == "portable" else NATIVE_BACKEND
    if mode == "auto" and library is not None:
        cpu_path += ", portable for a node it does not support"
    return {
        "present": library is not None,
        "path": str(library.path) if library is not None else None,
        "isa": library.isa if library is not None else None,
        "absent_reason": absent_reason() or None,
        "mode": mode,
        "cpu_paged_attention": cpu_path,
    }
