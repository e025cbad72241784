"""The request guards of :class:`~ortpa.serve.limits.ServeLimits` that act before a route parses anything.

The body is read through :func:`read_body`: a ``Content-Length`` past the limit is refused before a byte of the body
is read, and a chunked body (no ``Content-Length``) as soon as what has arrived passes the limit; uvicorn stops
reading from the socket while the app does not ask for more, so a refused body is never buffered whole.
:class:`KeyConcurrency` counts each API key's requests from their start to their response's last byte (a stream
until its ``[DONE]``) and answers the one past the limit with a 429 before it reaches a route.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable, Sequence
from typing import Any

from ortpa.serve.protocol import ApiError, error_body

__all__ = ["KeyConcurrency", "bearer_token", "matching_key", "read_body"]


def _too_large(limit: int, found: str) -> ApiError:
    return ApiError(
        413,
        f"the request body is {found}, past this server's limit of {limit} bytes (--max-body-bytes)",
        code="request_too_large",
    )


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a starlette ``Request``, refused (:class:`ApiError` 413) as soon as it is known to pass
    ``limit`` bytes: from its ``Content-Length`` before reading, else while its chunks arrive."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > limit:
        raise _too_large(limit, f"{int(declared)} bytes (Content-Length)")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit, f"more than {limit} bytes (read so far: {size})")
        chunks.append(chunk)
    return b"".join(chunks)


def bearer_token(headers: Any) -> str:
    """The KEY of an ``Authorization: Bearer KEY`` header ("" when there is none)."""
    given = headers.get("authorization", "")
    return given[7:] if given.lower().startswith("bearer ") else ""


def matching_key(token: str, keys: Sequence[str]) -> str | None:
    """The configured key ``token`` equals, compared in constant time against every key."""
    found = None
    for key in keys:
        if hmac.compare_digest(token.encode(), key.encode()):
            found = key
    return found


class KeyConcurrency:
    """ASGI wrapper: at most ``limit`` requests in flight per configured API key on the routes ``gated(path)``
    names; the one past it is answered 429 at once. Requests without a valid key pass through (the route answers
    them 401)."""

    def __init__(
        self, app: Any, keys: Sequence[str], limit: int, gated: Callable[[str], bool], on_refused: Callable[[], None]
    ) -> None:
        self.app = app
        self.keys = list(keys)
        self.limit = limit
        self.gated = gated
        self.on_refused = on_refused
        self.in_flight: dict[str, int] = {}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not self.gated(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        key = matching_key(bearer_token(headers), self.keys)
        if key is None:
            await self.app(scope, receive, send)
            return
        if self.in_flight.get(key, 0) >= self.limit:
            self.on_refused()
            await _send_json(send, 429, _busy_key(self.limit), {"retry-after": "1"})
            return
        self.in_flight[key] = self.in_flight.get(key, 0) + 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight[key] -= 1


def _busy_key(limit: int) -> dict[str, Any]:
    return error_body(
        f"this API key already has {limit} requests in flight, the most this server allows one key "
        "(--max-concurrent-per-key); retry when one has finished",
        "requests",
        code="rate_limit_exceeded",
    )


async def _send_json(send: Any, status: int, body: dict[str, Any], headers: dict[str, str]) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in headers.items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
