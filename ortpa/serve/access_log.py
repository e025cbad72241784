"""One access-log line per HTTP request: request id, method, path, status, tokens, latency.

A plain ASGI wrapper (no response copying, no queue): it notes the status when the response starts and writes
the line when the response has been sent, streamed ones included. Routes that generate leave
``request.state.access = (request_id, usage)`` (``usage()``: the token counts so far), read at the end.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

__all__ = ["AccessLog", "access_logger"]


def access_logger() -> logging.Logger:
    """``ortpa.serve.access``, writing to stderr at INFO whatever the server's log level (``--no-access-log``
    leaves it out)."""
    log = logging.getLogger("ortpa.serve.access")
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log


class AccessLog:
    def __init__(self, app: Any, log: logging.Logger) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 0

        async def noting(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, noting)
        finally:
            state = scope.get("state") or {}
            request_id, usage = state.get("access", ("-", None))
            tokens = ""
            if usage is not None:
                u = usage()
                tokens = f" prompt_tokens={u['prompt_tokens']} completion_tokens={u['completion_tokens']}"
            self.log.info(
                "%s %s %s %d%s %.3fs",
                request_id,
                scope.get("method", "-"),
                scope.get("path", "-"),
                status,
                tokens,
                time.perf_counter() - start,
            )
