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
    "InvalidParameter",
    "InvalidRequest",
    "InvalidSamplingParams",
    "InvalidSequenceOp",
    "KVPoolTooLarge",
    "MissingExtra",
    "NotImplementedByBackend",
    "OrtpaError",
    "OutOfBlocks",
    "RequestTooLarge",
    "RequestTooLong",
    "SplitRefused",
    "StageFailed",
    "Unavailable",
    "UnknownRequest",
    "UnknownSequence",
    "UnsupportedModel",
]


def _rebuild(cls: type, args: tuple, state: dict) -> OrtpaError:
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class OrtpaError(Exception):
    """Base class of every error ortpa raises on purpose.

    Picklable across processes whatever a subclass's constructor takes: the message (``args``) and the fields
    (``__dict__``) are restored as they are, without calling ``__init__`` again (the default pickling would call
    it with the message as the only argument).
    """

    def __reduce__(self):
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


class InvalidParameter(OrtpaError, ValueError):
    """A caller's parameter out of its domain: a session dimension, a prompt, a provider, a benchmark name.

    Not about a model (:class:`InvalidModel`) nor a PagedAttention node (:class:`InvalidArgument`).
    """

    def __init__(self, where: str, name: str, expected: str, found: object) -> None:
        self.where = where
        self.name = name
        self.expected = expected
        self.found = found
        super().__init__(f"{where}: {name}: expected {expected}, found {found!r}")


class InvalidSamplingParams(InvalidParameter):
    """A :class:`~ortpa.runtime.sampling.SamplingParams` field outside its range."""

    def __init__(self, name: str, expected: str, found: object) -> None:
        self.where, self.name, self.expected, self.found = "SamplingParams", name, expected, found
        OrtpaError.__init__(self, f"SamplingParams.{name}: expected {expected}, found {found!r}")


class InvalidArgument(OrtpaError, ValueError):
    """A PagedAttention input or attribute breaks one of ONNX Runtime's rules (a node of a model).

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


class Unavailable(OrtpaError, RuntimeError):
    """This machine lacks what a command needs (an optional extra, a free port): neither the model nor the
    command line is wrong, and the same command runs where that is fixed (the CLI's exit code 3)."""


class MissingExtra(Unavailable, ImportError):
    """An optional extra is not installed: what needs it, which extra, the packages missing."""

    def __init__(self, what: str, extra: str, missing: list[str]) -> None:
        self.what = what
        self.extra = extra
        self.missing = list(missing)
        super().__init__(
            f"{what} needs the {extra} extra, and {', '.join(self.missing)} is not installed: "
            f"pip install 'ortpa[{extra}]' (from a checkout: pip install '.[{extra}]')"
        )


class InvalidModel(OrtpaError, ValueError):
    """A model file cannot be read or is not a well-formed ONNX model."""

    def __init__(self, path: str, reason: str) -> None:
        self.path = path
        self.reason = reason
        super().__init__(f"{path}: {reason}")


class UnsupportedModel(InvalidModel):
    """A well-formed model ortpa refuses up front, saying why; nothing was written. ``mixes_sequences``: the
    model's own computation makes one sequence's tokens depend on the others sharing its step (no per-sequence
    paged model can represent it)."""

    def __init__(self, path: str, reason: str, *, mixes_sequences: bool = False) -> None:
        super().__init__(path, reason)
        self.mixes_sequences = mixes_sequences


class ConversionError(OrtpaError):
    """A model, or one of its layers, could not be converted; nothing was written."""

    def __init__(self, reason: str, failures: list[tuple[str, str]] | None = None) -> None:
        self.reason = reason
        self.failures = list(failures or [])
        lines = [reason] + [f"  {where}: {why}" for where, why in self.failures]
        super().__init__("\n".join(lines))


class OutOfBlocks(OrtpaError, RuntimeError):
    """The KV block pool cannot satisfy a request; nothing was allocated."""

    def __init__(self, requested: int, free: int, what: str = "") -> None:
        self.requested = requested
        self.free = free
        self.what = what
        ctx = f" for {what}" if what else ""
        super().__init__(f"out of KV cache blocks{ctx}: needed {requested}, {free} free")


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


class ConcurrentUse(OrtpaError, RuntimeError):
    """An object one thread must drive (an Engine's step loop) was entered by a second thread at once."""

    def __init__(self, what: str, owner: str) -> None:
        self.what = what
        self.owner = owner
        super().__init__(f"{what} is already in use by thread {owner!r}; drive it from one thread at a time")


class InvalidSequenceOp(OrtpaError, ValueError):
    """A cache call with bad arguments: duplicate id, negative count, too narrow block_table, ..."""


class InvalidRequest(OrtpaError, ValueError):
    """A request the engine cannot take: empty prompt, token id out of range, duplicate id, ..."""


class RequestTooLarge(InvalidRequest):
    """A request whose longest possible sequence needs more blocks than the whole pool holds."""

    def __init__(self, request_id: str, tokens: int, blocks: int, num_blocks: int, block_size: int) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.blocks = blocks
        self.num_blocks = num_blocks
        self.block_size = block_size
        super().__init__(
            f"request {request_id!r}: up to {tokens} tokens need {blocks} KV blocks of {block_size}, but the pool "
            f"holds {num_blocks}; shorten the prompt or max_new_tokens, or give the engine more blocks"
        )


class RequestTooLong(RequestTooLarge):
    """A request whose longest possible sequence runs past the model's position table (RoPE in the op).

    The op reads ``cos_cache[position]`` with no bounds check on CUDA, so such a request would read outside the
    table there (and be clamped, silently wrong, by the portable op): it is refused when added instead.
    """

    def __init__(self, request_id: str, tokens: int, max_model_len: int) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.max_model_len = max_model_len
        InvalidRequest.__init__(
            self,
            f"request {request_id!r}: up to {tokens} tokens, but the model's rotary position table holds "
            f"{max_model_len} positions; shorten the prompt or max_new_tokens, or convert with a larger "
            f"max_positions",
        )


class UnknownRequest(OrtpaError, KeyError):
    """A request id the engine does not hold (never added, or already finished)."""

    def __init__(self, request_id: str, where: str) -> None:
        self.request_id = request_id
        self.where = where
        super().__init__(f"{where}: unknown request {request_id!r} (expected an id added and not yet finished)")

    def __str__(self) -> str:  # KeyError would print repr(message)
        return str(self.args[0])


class KVPoolTooLarge(OrtpaError, MemoryError):
    """A KV pool (``num_blocks`` x the model's declared cache dims) larger than the device's memory.

    Refused before anything is allocated: ``np.zeros`` of an absurd size may "succeed" lazily on an
    overcommitting host and then kill the process on first write.
    """

    def __init__(self, where: str, requested: int, available: int, detail: str = "") -> None:
        self.where = where
        self.requested = requested
        self.available = available
        self.detail = detail
        super().__init__(
            f"{where}: the KV caches need {requested:,} bytes but the device has {available:,}"
            + (f" ({detail})" if detail else "")
            + "; use fewer blocks, or check the model's declared cache dims"
        )


class SplitRefused(OrtpaError, ValueError):
    """A paged model that cannot be split into pipeline stages as asked (``ortpa split``), with the reason;
    nothing was written."""

    def __init__(self, model: str, reason: str) -> None:
        self.model = model
        self.reason = reason
        super().__init__(f"{model}: cannot split into stages: {reason}")


class StageFailed(OrtpaError, RuntimeError):
    """A pipeline stage's process died (or failed) during a step: the requests in flight lost the cache of its
    layers and were ended; the stage was restarted with a fresh cache (``restarted``) for new requests."""

    def __init__(self, stage: int, reason: str, restarted: bool) -> None:
        self.stage = stage
        self.reason = reason
        self.restarted = restarted
        super().__init__(
            f"pipeline stage {stage} failed: {reason}; the requests in flight were ended (their cache for the "
            f"stage's layers is lost)" + ("; the stage was restarted with a fresh cache" if restarted else "")
        )
