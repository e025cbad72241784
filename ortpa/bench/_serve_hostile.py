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

__all__ = [
    "Answer",
    "Hostile",
    "Round",
    "hostile_round",
    "post",
    "prompt_request",
    "soak_hostiles",
    "soak_rows",
    "stream",
]

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
            # drain() returns at once while the socket takes the bytes: yield, so that the answer's reader runs
            # between two pieces (a loaded machine otherwise wrote tens of MB before it looked)
            await asyncio.sleep(0)
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


# --- the soak of ``ortpa bench --only serve``: rows ``serve hostile ...`` ---

_POSITIONS = 4096  # streams of thousands of tokens outlast a round
_WORDS = 200_000
_NAME = "toy-long"
_TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}assistant"


def _write_folder(folder) -> None:
    import onnx
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from ortpa.testing.toy_lm import ToyLMConfig, build_toy_lm

    config = ToyLMConfig(vocab=512, hidden=64, num_heads=2, kv_heads=1, num_layers=1, max_positions=_POSITIONS)
    onnx.save(build_toy_lm(config), str(folder / "model.onnx"))
    words = ["hello", "user", "assistant"] + [f"w{i}" for i in range(config.vocab - 4)] + ["[UNK]"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": _TEMPLATE}))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": _POSITIONS}))


def prompt_request(model: str, count: int, ids: bool = False, chat: bool = False) -> Hostile:
    """A request whose prompt is ``count`` words ("hello hello ...") or token ids, to chat or completions."""
    prompt: str | list[int] = [5] * count if ids else " ".join(["hello"] * count)
    fields = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    name = f"{'chat ' if chat else ''}{count} {'ids' if ids else 'words'}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Hostile(name, path, body=json.dumps({"model": model, "max_tokens": 4, **fields}).encode())


def soak_hostiles(model: str = _NAME) -> list[Hostile]:
    """200,000 words (chat and completions) and token ids; 40,000 words (chat and completions) and 30,000 ids;
    a 50 MB body, sent with its length and chunked."""
    return [
        prompt_request(model, _WORDS, chat=True),
        prompt_request(model, _WORDS),
        prompt_request(model, _WORDS, ids=True),
        prompt_request(model, 40_000, chat=True),
        prompt_request(model, 40_000),
        prompt_request(model, 30_000, ids=True),
        Hostile("50 MB body", "/v1/completions", size=50_000_000),
        Hostile("50 MB chunked", "/v1/completions", size=50_000_000, chunked=True),
    ]


def soak_rows(quick: bool = False) -> list[dict]:
    """Rounds of the hostile requests beside 4 streams, under the default limits and with the body and prompt limits
    raised past the 200,000 words (so they are parsed, rendered and tokenized: the worst case for a tokenizer
    without a bytes-per-token bound, as this word-level one): each hostile request's answer time and status, and the
    largest growth of a stream's longest gap between chunks over its quiet window, median and worst over the
    rounds."""
    import os
    import statistics
    import tempfile
    from pathlib import Path

    from ortpa.bench._server import live_server

    rounds = 2 if quick else 8
    env = f"toy LM 1 layer, {_POSITIONS} positions; 4 streams; {os.cpu_count()} cpus shared by client and server"
    rows = []
    raised = ["--max-body-bytes", str(4 * _WORDS * 6), "--max-prompt-bytes", str(4 * _WORDS * 6)]
    configs = {"defaults": [], "limits raised": raised}
    with tempfile.TemporaryDirectory(prefix="ortpa-bench-hostile-") as tmp:
        folder = Path(tmp)
        _write_folder(folder)
        for label, extra in configs.items():
            with live_server(folder, _NAME, ["--num-blocks", "1100", *extra]) as url:
                port = int(url.rsplit(":", 1)[1])
                results = [
                    asyncio.run(hostile_round("127.0.0.1", port, _NAME, soak_hostiles(), max_tokens=4000))
                    for _ in range(rounds)
                ]
            name = f"serve hostile ({label})"
            notes = f"{rounds} rounds; {env}"
            increases = [1e3 * r.worst_increase for r in results]
            quiet = [1e3 * max(r.baseline) for r in results]
            rows += [
                _row(name, "largest gap growth, median", statistics.median(increases), "ms", notes),
                _row(name, "largest gap growth, worst", max(increases), "ms", "over the rounds"),
                _row(name, "quiet largest gap, median", statistics.median(quiet), "ms", "the baseline"),
            ]
            for h in soak_hostiles():
                times = [1e3 * r.answers[h.name].seconds for r in results]
                statuses = sorted({r.answers[h.name].status for r in results})
                rows += [
                    _row(name, f"{h.name}: answer median", statistics.median(times), "ms", f"status {statuses}"),
                    _row(name, f"{h.name}: answer worst", max(times), "ms", ""),
                ]
    return rows


def _row(name: str, metric: str, value: float, unit: str, notes: str) -> dict:
    return {"name": name, "metric": metric, "value": value, "unit": unit, "notes": notes}


if __name__ == "__main__":
    import sys

    from ortpa.bench import format_table

    print(format_table(soak_rows(quick="--quick" in sys.argv)))
