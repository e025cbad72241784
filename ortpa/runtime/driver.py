"""The single-driver guard of :class:`ortpa.runtime.engine.Engine`: one thread steps an engine at a time."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ortpa.errors import ConcurrentUse

__all__ = ["SingleDriver"]


class SingleDriver:
    """At most one thread drives an engine (``step``, ``generate``) at a time; re-entrant for that thread.

    A second driver is refused rather than queued: tokens go to whoever called ``step``, so two threads
    stepping one engine would each lose the other's tokens (and ``generate`` could wait forever for them).
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._owner_name = ""
        self._depth = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._lock:
            if self._owner not in (None, me):
                raise ConcurrentUse(self._what, self._owner_name)
            self._owner, self._owner_name = me, threading.current_thread().name
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
