"""KV pool sizing and block copies: the parts of the paged cache that touch bytes, not block ids.

:mod:`ortpa.runtime.kv` decides *which* blocks to copy (copy-on-write); :func:`copy_blocks` moves them. It
runs numpy caches itself and takes a ``copier`` for anything else, which is the seam for the session's
device-memory copy of OrtValues.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from ortpa.dtypes import bits

__all__ = [
    "BlockCopier",
    "blocks_for_budget",
    "blocks_from_device_memory",
    "bytes_per_block",
    "copy_blocks",
    "device_memory_bytes",
]

# copier(cache, src_block, dst_block): make block dst of one cache tensor a copy of block src.
BlockCopier = Callable[[Any, int, int], None]


def _row_bytes(head_size: int, dtype: Any) -> int:
    try:
        width = bits(dtype)
    except TypeError:
        raise ValueError(
            f"bytes_per_block: unknown cache dtype {dtype!r} (expected a cache dtype name such as 'float16', "
            "'bfloat16', 'int8', 'float8e4m3fn', 'int4', or a numpy dtype)"
        ) from None
    if width == 4:
        return (head_size + 1) // 2  # two values per uint8, last dim (head_size + 1) // 2 as the op expects
    return head_size * width // 8


def bytes_per_block(
    block_size: int,
    kv_heads: int,
    head_size: int,
    dtype: Any,
    num_layers: int,
    has_value_cache: bool,
    value_head_size: int | None = None,
) -> int:
    """Bytes one block id costs across every layer's key cache and, if present, value cache.

    A layer's cache is ``[num_blocks, block_size, kv_heads, head_size]``; LATENT layouts pass ``kv_heads=1``,
    the latent width as ``head_size`` and ``has_value_cache=False``. ``dtype`` is a numpy dtype or a cache
    dtype name (``"float16"``, ``"bfloat16"``, ``"int8"``, ``"float8e4m3fn"``, ``"int4"``...). Quantization
    scales are per channel, not per block, so they do not count here.
    """
    for name, v in (
        ("block_size", block_size),
        ("kv_heads", kv_heads),
        ("head_size", head_size),
        ("num_layers", num_layers),
    ):
        if v < 1:
            raise ValueError(f"bytes_per_block: {name} must be >= 1, got {v}")
    key = block_size * kv_heads * _row_bytes(head_size, dtype)
    value = block_size * kv_heads * _row_bytes(value_head_size or head_size, dtype) if has_value_cache else 0
    return num_layers * (key + value)


def blocks_for_budget(bytes_budget: int, bytes_per_block: int) -> int:
    """How many whole blocks fit in ``bytes_budget`` bytes (may be 0)."""
    if bytes_per_block < 1:
        raise ValueError(f"blocks_for_budget: bytes_per_block must be >= 1, got {bytes_per_block}")
    if bytes_budget < 0:
        raise ValueError(f"blocks_for_budget: bytes_budget must be >= 0, got {bytes_budget}")
    return int(bytes_budget) // int(bytes_per_block)


def _cudart() -> Any:
    try:  # cuda-python >= 12.6 moved the bindings; older releases expose cuda.cudart
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart
        except ImportError as e:
            raise ImportError(
                "blocks_from_device_memory needs cuda-python (pip install 'ortpa[cuda]'); "
                "on CPU size the pool with blocks_for_budget"
            ) from e
    return cudart


def _check(err: Any, call: str) -> None:
    if int(err) != 0:  # cudaError_t.cudaSuccess
        raise RuntimeError(f"{call} failed: {err!r}")


def blocks_from_device_memory(bytes_per_block: int, memory_fraction: float = 0.9, device_id: int = 0) -> int:
    """How many blocks fit in ``memory_fraction`` of the device's *currently free* memory.

    Free, not total, memory: call it after the session has loaded its weights, so the pool takes what is
    left. Uses cuda-python's ``cudaMemGetInfo`` (imported here, so importing ortpa never needs it); the
    current device is restored afterwards.
    """
    if not 0.0 < memory_fraction <= 1.0:
        raise ValueError(f"blocks_from_device_memory: memory_fraction must be in (0, 1], got {memory_fraction}")
    cudart = _cudart()
    err, previous = cudart.cudaGetDevice()
    _check(err, "cudaGetDevice")
    (err,) = cudart.cudaSetDevice(device_id)
    _check(err, f"cudaSetDevice({device_id})")
    try:
        err, free, _total = cudart.cudaMemGetInfo()
        _check(err, "cudaMemGetInfo")
    finally:
        cudart.cudaSetDevice(previous)
    return blocks_for_budget(int(int(free) * memory_fraction), bytes_per_block)


def device_memory_bytes(device: str, device_id: int = 0) -> int | None:
    """Total memory of the device a pool would live on (host RAM for ``"cpu"``); ``None`` if unknown.

    Total, not free: it bounds what a pool could ever take, so a pool above it is certainly wrong, while one
    below it may still fail later in the allocator with that allocator's own error.
    """
    if device == "cpu":
        try:
            return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
        except (AttributeError, ValueError, OSError):  # not POSIX, or the name is unknown there
            return None
    try:
        cudart = _cudart()
    except ImportError:
        return None
    err, previous = cudart.cudaGetDevice()
    if int(err) != 0:
        return None
    try:
        (err,) = cudart.cudaSetDevice(device_id)
        if int(err) != 0:
            return None
        err, _free, total = cudart.cudaMemGetInfo()
        return int(total) if int(err) == 0 else None
    finally:
        cudart.cudaSetDevice(previous)


def _numpy_copier(cache: np.ndarray, src: int, dst: int) -> None:
    cache[dst] = cache[src]


def copy_blocks(caches: Sequence[Any], pairs: Iterable[tuple[int, int]], copier: BlockCopier | None = None) -> None:
    """Copy block ``src`` to block ``dst`` along axis 0 of every cache, for each pair, in order.

    Order matters: a later pair may read a block an earlier pair wrote (copy-on-write chains). Without a
    ``copier`` the caches must be writable numpy arrays; pass one for device buffers (OrtValues).
    """
    pairs = list(pairs)
    if copier is None:
        copier = _numpy_copier
        for i, cache in enumerate(caches):
            if not isinstance(cache, np.ndarray):
                raise TypeError(
                    f"copy_blocks: cache {i} is {type(cache).__name__} (expected numpy.ndarray, or pass copier=)"
                )
            for src, dst in pairs:
                if not (0 <= src < cache.shape[0] and 0 <= dst < cache.shape[0]):
                    raise IndexError(
                        f"copy_blocks: pair ({src}, {dst}) out of range for cache {i} of {cache.shape[0]} blocks"
                    )
    for src, dst in pairs:
        for cache in caches:
            copier(cache, src, dst)
