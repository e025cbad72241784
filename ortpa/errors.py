"""Typed errors shared by every layer of ortpa.

Every error says what was expected, what was found, and where (node, input or attribute, rule id).
Each derives from :class:`OrtpaError` and from the builtin exception a caller would naturally catch
(``ValueError`` for bad input, ``NotImplementedError`` for unsupported modes, ...).
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = [
    "BlockRefError",
    "ConcurrentUse",
    "ConversionError",
    "InvalidArgument",
    "InvalidModel",
    "InvalidSequenceOp",
    "NotImplementedByBackend",
    "OrtpaError",
    "OutOfBlocks",
    "UnknownSequence",
]


class OrtpaError(Exception):
    """Base class of every error ortpa raises on purpose."""


class InvalidArgument(OrtpaError, ValueError):
    """A PagedAttention input or attribute breaks one of ONNX Runtime's rules.

    ``rule`` is a stable id (``"1.5.2"`` style ids follow the reference's sections, ``"ctor.*"`` the kernel
    constructor, ``"schema.*"`` shape inference); ``name`` is the offending input or attribute;
    ``message`` is ONNX Runtime's own error text; ``node`` the node name when known.
    """

    def __init__(self, rule: str, name: str, message: str, node: str | None = None) -> None:
        self.rule = rule
        self.name = name
        self.message = message
        self.node = node
        where = f"node {node!r}, " if node else ""
        super().__init__(f"[{rule}] {where}{name}: {message}")

    def __reduce__(self):  # keep the error picklable across processes
        return (type(self), (self.rule, self.name, self.message, self.node))


class NotImplementedByBackend(OrtpaError, NotImplementedError):
    """A schema-valid PagedAttention node uses a feature the chosen backend cannot run."""

    def __init__(self, backend: str, feature: str, detail: str = "", node: str | None = None) -> None:
        self.backend = backend
        self.feature = feature
        self.detail = detail
        self.node = node
        where = f" (node {node!r})" if node else ""
        extra = f": {detail}" if detail else ""
        super().__init__(f"backend {backend!r} does not implement {feature}{where}{extra}")

    def __reduce__(self):
        return (type(self), (self.backend, self.feature, self.detail, self.node))


class InvalidModel(OrtpaError, ValueError):
    """A model file cannot be read or is not a well-formed ONNX model."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")

    def __reduce__(self):
        return (type(self), (self.path, self.reason))


class ConversionError(OrtpaError):
    """A model, or one of its layers, could not be converted; nothing was written."""

    def __init__(self, reason: str, failures: list[tuple[str, str]] | None = None) -> None:
        self.reason = reason
        self.failures = list(failures or [])
        lines = [reason] + [f"  {where}: {why}" for where, why in self.failures]
        super().__init__("\n".join(lines))

    def __reduce__(self):
        return (type(self), (self.reason, self.failures))


class OutOfBlocks(OrtpaError, RuntimeError):
    """The KV block pool cannot satisfy a request; nothing was allocated."""

    def __init__(self, requested: int, free: int, what: str = "") -> None:
        self.requested = requested
        self.free = free
        self.what = what
        ctx = f" for {what}" if what else ""
        super().__init__(f"out of KV cache blocks{ctx}: needed {requested}, {free} free")

    def __reduce__(self):
        return (type(self), (self.requested, self.free, self.what))


class BlockRefError(OrtpaError, RuntimeError):
    """A block id was freed or shared while not allocated (double free), or is out of range."""


class UnknownSequence(OrtpaError, KeyError):
    """A sequence id that the cache does not hold."""

    def __init__(self, seq_id: Hashable, where: str) -> None:
        self.seq_id = seq_id
        self.where = where
        super().__init__(f"{where}: unknown sequence {seq_id!r} (expected an id added and not yet freed)")

    def __str__(self) -> str:  # KeyError would print repr(message); say it plainly
        return str(self.args[0])

    def __reduce__(self):
        return (type(self), (self.seq_id, self.where))


class ConcurrentUse(OrtpaError, RuntimeError):
    """An object one thread must drive (an Engine's step loop) was entered by a second thread at once."""

    def __init__(self, what: str, owner: str) -> None:
        self.what = what
        self.owner = owner
        super().__init__(f"{what} is already in use by thread {owner!r}; drive it from one thread at a time")

    def __reduce__(self):
        return (type(self), (self.what, self.owner))


class InvalidSequenceOp(OrtpaError, ValueError):
    """A cache call with bad arguments: duplicate id, negative count, too narrow block_table, ..."""
