"""The machinery every rule module shares: input stand-ins, shape reading, and the rule recorder.

:class:`TensorInfo` stands in for an input whose shape/dtype is known but whose values are not. The shape
helpers read a dimension as declared (an int, a symbolic name, or None) so that a rule can tell "unknown"
from "wrong". :class:`Rules` raises :class:`~ortpa.errors.InvalidArgument` for a broken rule and records a
rule it cannot decide (because a value it needs is unknown) as ``(rule_id, reason)`` in ``unchecked``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ortpa.errors import InvalidArgument

__all__ = ["Rules", "TensorInfo", "dim", "fmt_shape", "present", "rank", "raw", "shape_of"]


@dataclass(frozen=True)
class TensorInfo:
    """A shape/dtype stand-in for an input: ``shape`` None means unknown rank; a dim None/str is symbolic."""

    shape: tuple[Any, ...] | None
    dtype: Any = None


def shape_of(x: Any) -> tuple[int | None, ...] | None:
    shape = getattr(x, "shape", None)
    if shape is None:
        return None
    try:
        dims = tuple(shape)
    except TypeError:
        return None
    # a negative dim is how several shape conventions spell "unknown"; a string is a symbolic name
    return tuple(
        int(d)
        if isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0
        else d
        if isinstance(d, str) and d
        else None
        for d in dims
    )


def fmt_shape(shape: tuple[int | None, ...]) -> str:
    """TensorShape::ToString(): {4,1,16}."""
    return "{" + ",".join("?" if d is None else str(d) for d in shape) + "}"


class Rules:
    """Raise on a broken rule; record a rule that needs an unknown value as unchecked."""

    def __init__(self, node: str | None, unchecked: list | None) -> None:
        self.node = node
        self.unchecked = unchecked if unchecked is not None else []

    def fail(self, rule: str, name: str, message: str) -> None:
        raise InvalidArgument(rule, name, message, node=self.node)

    def check(self, rule: str, name: str, deps: Mapping[str, Any], broken, message) -> bool:
        """``broken()``/``message()`` are only called when every dep is known. Returns True if decided."""
        unknown = [k for k, v in deps.items() if v is None]
        if unknown:
            self.unchecked.append((rule, f"needs {', '.join(unknown)}, which is not known"))
            return False
        if broken():
            self.fail(rule, name, message())
        return True

    def has_rank(
        self, rule: str, name: str, shape: tuple | None, expected: int, message: Callable[[int], str] | None = None
    ) -> None:
        """``name`` has ``expected`` dims; ``message(rank)`` overrides ONNX Runtime's usual wording."""
        n = rank(shape)
        plural = "" if expected == 1 else "s"
        text = message or (lambda n: f"Input '{name}' is expected to have {expected} dimension{plural}, got {n}")
        self.check(rule, name, {f"rank of {name}": n}, lambda: n != expected, lambda: text(n))

    def dim_is(
        self, rule: str, name: str, shape: tuple | None, i: int, expected: int, message: Callable[[int], str]
    ) -> None:
        """Dim ``i`` of ``name`` equals the known number ``expected``; ``message(dim)`` says what was found."""
        got = dim(shape, i)
        self.check(rule, name, {f"{name} dim {i}": got}, lambda: got != expected, lambda: message(got))

    def same(self, rule: str, name: str, x: tuple[str, Any], y: tuple[str, Any], message) -> None:
        """Equality of two dims: concrete ints compare; one symbolic name on both sides is equal."""
        (_, xv), (_, yv) = x, y
        if isinstance(xv, int) and isinstance(yv, int):
            if xv != yv:
                self.fail(rule, name, message())
        elif xv is None or yv is None or xv != yv:
            unknown = [lbl for lbl, v in (x, y) if not isinstance(v, int)]
            self.unchecked.append((rule, f"needs {', '.join(unknown)}, which is not known"))


def present(inputs: Mapping[str, Any], name: str) -> bool:
    return inputs.get(name) is not None


def rank(shape: tuple | None) -> int | None:
    return None if shape is None else len(shape)


def raw(shape: tuple | None, i: int) -> int | str | None:
    """Dim ``i`` as declared: an int, a symbolic name, or None (unknown rank, out of range, unnamed)."""
    if shape is None or not -len(shape) <= i < len(shape):
        return None
    return shape[i]


def dim(shape: tuple | None, i: int) -> int | None:
    """Dim ``i`` when it is a concrete number, else None."""
    d = raw(shape, i)
    return d if isinstance(d, int) else None
