"""Hostile requests against a live ``ortpa serve`` while streams run: does any of them pause the others?

A raw asyncio HTTP client (no library buffering between the socket and the clock): :func:`stream` records when
each chunk of a streamed completion arrives; :func:`post` sends one request, its body written in pieces while the
answer is awaited (a server that answers before the body is all sent stops the sending), and times the answer.
:func:`hostile_round` runs streams, measures their largest gap between chunks in a quiet window, then while the
hostile requests are sent, one after the other; the serve tests assert on it and ``ortpa bench`` reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Answer", "Hostile", "Round", "hostile_round", "post", "stream"]

_PIECE = 1 << 16


@dataclass
class Answer:
    status: int
    body: bytes
    seconds: float  # from the first byte sent to the whole answer read
    sent: int  # body bytes written before the answer came (or all of them)

    def json(self) -> dict:
        return json.loads(self.body)


@dataclass(frozen=True)
class Hostile:
    """One request to send: ``body`` as bytes, or ``size`` bytes of filler (a huge body never built in memory)."""

    name: str
    path: str
    body: bytes = b""
    size: int = 0
    chunked: bool = False  # Transfer-Encoding: chunked (no Content-Length)

    def pieces(self) -> Iterator[bytes]:
        if self.body:
            for i in range(0, len(self.body), _PIECE):
                yield self.body[i : i + _PIECE]
            return
        filler = b" " * _PIECE
        for i in range(0, self.size, _PIECE):
            yield filler[: min(_PIECE, self.size - i)]


def _head(method: str, path: str, host: str, headers: dict[str, str]) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    return "\r\n".join(lines).encode()


async def _read_answer(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    return status, headers, b""


async def post(host: str, port: int, hostile: Hostile, headers: dict[str, str] | None = None) -> Answer:
    """Send ``hostile`` and time its answer; the body stops being written as soon as the answer is in."""
    reader, writer = await asyncio.open_connection(host, port)
    extra = {"Content-Type": "application/json", **(headers or {})}
    if hostile.chunked:
        extra["Transfer-Encoding"] = "chunked"
    else:
        extra["Content-Length"] = str(len(hostile.body) or hostile.size)
    start = time.perf_counter()
    answer = asyncio.ensure_future(_read_answer(reader))
    sent = 0
    try:
        writer.write(_head("POST", hostile.path, f"{host}:{port}", extra))
        for piece in hostile.pieces():
            if answer.done():
                break
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece) if hostile.chunked else piece)
            await writer.drain()
            sent += len(piece)
        if hostile.chunked and not answer.done():
            writer.write(b"0\r\n\r\n")
            await writer.drain()
    except (ConnectionError, OSError):  # the server closed its end after answering early
        pass
    try:
        status, _, body = await answer
        return Answer(status, body, time.perf_counter() - start, sent)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


@dataclass
class Stream:
    arrivals: list[float] = field(default_factory=list)
    status: int = 0

    def largest_gap(self, start: float, end: float) -> float:
        """The longest wait between two chunks (or from ``start`` to the first) that overlaps [start, end]."""
        times = [start] + [t for t in self.arrivals if t > start]
        gaps = [b - a for a, b in itertools.pairwise(times) if a < end]
        return max(gaps, default=float("inf"))


async def stream(host: str, port: int, body: dict, out: Stream, headers: dict[str, str] | None = None) -> None:
    """POST a streamed completion and note when each piece of it arrives, until the server closes the stream."""
    raw = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection(host, port)
    extra = {"Content-Type": "application/json", "Content-Length": str(len(raw)), **(headers or {})}
    writer.write(_head("POST", "/v1/completions", f"{host}:{port}", extra) + raw)
    await writer.drain()
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        out.status = int(head.split()[1])
        tail = b""
        while True:
            data = await reader.read(_PIECE)
            if not data:
                break
            out.arrivals.append(time.perf_counter())
            tail = (tail + data)[-32:]
            if b"[DONE]" in tail:
                break
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await writer.wait_closed()


@dataclass
class Round:
    """``baseline``: each stream's largest gap in the quiet window; ``during``: while the hostile requests ran."""

    baseline: list[float]
    during: list[float]
    answers: dict[str, Answer]
    quiet_s: float
    hostile_s: float

    @property
    def worst_increase(self) -> float:
        return max(d - b for b, d in zip(self.baseline, self.during, strict=True))


async def hostile_round(
    host: str,
    port: int,
    model: str,
    hostiles: list[Hostile],
    *,
    streams: int = 4,
    max_tokens: int = 200,
    quiet_s: float = 0.6,
    headers: dict[str, str] | None = None,
) -> Round:
    """``streams`` streamed completions; once each has sent a chunk, ``quiet_s`` of quiet, then ``hostiles`` one
    after the other; the streams must outlast both windows (``max_tokens``)."""
    body = {"model": model, "prompt": "hello", "max_tokens": max_tokens, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    records = [Stream() for _ in range(streams)]
    tasks = [asyncio.ensure_future(stream(host, port, body, r, headers)) for r in records]
    try:
        while not all(len(r.arrivals) >= 2 for r in records):
            if any(t.done() for t in tasks):
                raise RuntimeError(f"a stream ended before the measurement (statuses {[r.status for r in records]})")
            await asyncio.sleep(0.01)
        quiet_start = time.perf_counter()
        await asyncio.sleep(quiet_s)
        hostile_start = time.perf_counter()
        answers = {h.name: await post(host, port, h, headers) for h in hostiles}
        hostile_end = time.perf_counter()
        await asyncio.sleep(0.05)  # a chunk held back by the last hostile request arrives now: its gap counts
        if any(t.done() for t in tasks):
            raise RuntimeError("a stream ended during the measurement: give it more max_tokens")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return Round(
        baseline=[r.largest_gap(quiet_start, hostile_start) for r in records],
        during=[r.largest_gap(hostile_start, hostile_end) for r in records],
        answers=answers,
        quiet_s=hostile_start - quiet_start,
        hostile_s=hostile_end - hostile_start,
    )
