"""The kernel's C interface through ctypes: fill ``OrtpaPagedAttentionArgs`` from NumPy arrays and run it.

Mirrors ``paged_attention.h`` field for field (a wrong layout would misread every argument: the tests compare
whole results with the oracle, so they would fail). The caches passed in are updated in place, as the op does.
Errors come back as :class:`~ortpa.errors.InvalidArgument` (the validator's rule id and wording) or
:class:`~ortpa.errors.NotImplementedByBackend`.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ortpa.errors import InvalidArgument, NotImplementedByBackend

__all__ = ["ABI_VERSION", "INPUT_NAMES", "KernelLibrary", "elem_type"]

ABI_VERSION = 1
MAX_RANK = 8
INPUT_NAMES = (
    "query",
    "key",
    "value",
    "key_cache",
    "value_cache",
    "cumulative_sequence_length",
    "past_seqlens",
    "block_table",
    "cos_cache",
    "sin_cache",
    "slot_mapping",
    "head_sink",
    "q_norm_weight",
    "k_norm_weight",
    "k_scale",
    "v_scale",
    "attention_metadata",
)
_ELEM = {
    np.dtype(np.float32): 1,
    np.dtype(np.uint8): 2,
    np.dtype(np.int8): 3,
    np.dtype(np.int32): 6,
    np.dtype(np.int64): 7,
    np.dtype(np.float16): 10,
    np.dtype(ml_dtypes.bfloat16): 16,
    np.dtype(ml_dtypes.float8_e4m3fn): 17,
}
_INT_ATTRS = ("num_heads", "kv_num_heads", "local_window_size", "do_rotary", "rotary_interleaved", "v_head_size",
              "rotary_offset", "is_causal")  # fmt: skip
_FLOAT_ATTRS = ("scale", "softcap", "qk_norm_epsilon")
_STR_ATTRS = ("kv_cache_layout", "k_quant_type", "v_quant_type", "k_cache_dtype", "v_cache_dtype")


def elem_type(dtype: Any) -> int:
    """The kernel's element-type code (ONNX numbering) of a NumPy dtype."""
    try:
        return _ELEM[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"native kernel: expected one of {sorted(map(str, _ELEM))}, found {np.dtype(dtype)}") from None


class Tensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("elem_type", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("dims", ctypes.c_int64 * MAX_RANK),
    ]


PARALLEL_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t)
PARALLEL_FOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p, PARALLEL_FN, ctypes.c_size_t, ctypes.c_void_p)


class Args(ctypes.Structure):
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("abi_version", ctypes.c_uint32),
        *[(name, Tensor) for name in INPUT_NAMES],
        ("output", Tensor),
        ("num_heads", ctypes.c_int64),
        ("kv_num_heads", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("softcap", ctypes.c_float),
        ("local_window_size", ctypes.c_int64),
        ("do_rotary", ctypes.c_int64),
        ("rotary_interleaved", ctypes.c_int64),
        ("v_head_size", ctypes.c_int64),
        ("rotary_offset", ctypes.c_int64),
        ("is_causal", ctypes.c_int64),
        ("qk_norm_epsilon", ctypes.c_float),
        *[(name, ctypes.c_char_p) for name in _STR_ATTRS],
        ("parallel_for", ctypes.c_void_p),
        ("parallel_ctx", ctypes.c_void_p),
        ("num_threads", ctypes.c_int32),
        ("reserved0", ctypes.c_int32),
    ]


_EMPTY = ctypes.c_char()


def _fill(t: Tensor, a: np.ndarray) -> None:
    if a.ndim > MAX_RANK:
        raise ValueError(f"native kernel: expected rank <= {MAX_RANK}, found {a.ndim}")
    # an empty input is still present: give it a non-null address (the kernel never reads it)
    t.data = a.ctypes.data or ctypes.addressof(_EMPTY)
    t.elem_type = elem_type(a.dtype)
    t.rank = a.ndim
    for i, d in enumerate(a.shape):
        t.dims[i] = d


class KernelLibrary:
    """The compiled kernel (a shared library exporting ``paged_attention.h``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        lib = ctypes.CDLL(str(path))
        lib.ortpa_paged_attention_args_init.argtypes = [ctypes.POINTER(Args)]
        lib.ortpa_paged_attention_args_init.restype = None
        lib.ortpa_paged_attention.argtypes = [ctypes.POINTER(Args), ctypes.c_char_p, ctypes.c_size_t]
        lib.ortpa_paged_attention.restype = ctypes.c_int
        lib.ortpa_paged_attention_output_shape.argtypes = [
            ctypes.POINTER(Args),
            ctypes.POINTER(ctypes.c_int64),
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        lib.ortpa_paged_attention_output_shape.restype = ctypes.c_int
        lib.ortpa_native_isa.restype = ctypes.c_char_p
        lib.ortpa_native_abi_version.restype = ctypes.c_uint32
        self._lib = lib
        if lib.ortpa_native_abi_version() != ABI_VERSION:
            raise RuntimeError(
                f"native kernel {path}: expected ABI version {ABI_VERSION}, found {lib.ortpa_native_abi_version()}"
            )

    @property
    def isa(self) -> str:
        return self._lib.ortpa_native_isa().decode()

    def prepare(self, inputs: Mapping[str, Any], attrs: Mapping[str, Any], *, threads: int = 1):
        """Build the call: ``(args, output, keep)``; ``keep`` holds the arrays the pointers refer to."""
        args = Args()
        self._lib.ortpa_paged_attention_args_init(ctypes.byref(args))
        keep: list[Any] = []
        for name in INPUT_NAMES:
            a = inputs.get(name)
            if a is None:
                continue
            a = np.asarray(a)
            if name in ("key_cache", "value_cache"):
                if not (a.flags.c_contiguous and a.flags.writeable):
                    raise ValueError(
                        f"native kernel: '{name}' is updated in place: expected a writable C-contiguous array"
                    )
            else:
                a = np.ascontiguousarray(a)
            keep.append(a)
            _fill(getattr(args, name), a)
        for name, value in attrs.items():
            if value is None:
                continue
            if name in _INT_ATTRS:
                setattr(args, name, int(value))
            elif name in _FLOAT_ATTRS:
                setattr(args, name, float(value))
            elif name in _STR_ATTRS:
                b = str(value).encode()
                keep.append(b)
                setattr(args, name, b)
            else:
                raise ValueError(f"native kernel: unknown attribute {name!r}")
        args.num_threads = int(threads)
        dims = (ctypes.c_int64 * 2)()
        err = ctypes.create_string_buffer(2048)
        if self._lib.ortpa_paged_attention_output_shape(ctypes.byref(args), dims, err, len(err)):
            raise _error(err.value.decode())
        q = np.asarray(inputs["query"])
        output = np.zeros((dims[0], dims[1]), q.dtype)
        keep.append(output)
        _fill(args.output, output)
        return args, output, keep

    def call(self, args: Args) -> None:
        err = ctypes.create_string_buffer(2048)
        if self._lib.ortpa_paged_attention(ctypes.byref(args), err, len(err)):
            raise _error(err.value.decode())

    def run(self, inputs: Mapping[str, Any], attrs: Mapping[str, Any], *, threads: int = 1) -> np.ndarray:
        """Run the op; returns the output. ``key_cache`` / ``value_cache`` are updated in place."""
        args, output, keep = self.prepare(inputs, attrs, threads=threads)
        self.call(args)
        del keep
        return output


def _error(text: str) -> Exception:
    """``[rule] name: message`` from the kernel as ortpa's exception."""
    rule, _, rest = text.partition("] ")
    name, _, message = rest.partition(": ")
    rule = rule.lstrip("[")
    if rule == "native.latent_int4":
        return NotImplementedByBackend("native-cpu", "kv_cache_layout=LATENT with an int4 cache", message)
    return InvalidArgument(rule, name, message)
