"""The engine's driving thread and the asyncio side of each request.

One thread (``ortpa-engine``) owns the :class:`~ortpa.runtime.engine.Engine`: it takes additions and aborts
from a queue between steps, runs steps while requests are unfinished, and hands each request's tokens to its
own ``asyncio.Queue`` with ``loop.call_soon_threadsafe``. The event loop therefore never waits for a step:
not even for the engine's lock, which a step holds (``Engine.add_request`` from the loop would wait for it).

A request's stream ends with its finish reason (``"stop"``, ``"length"``, ``"abort"``) or an exception: the
error the engine raised adding it, or one a step raised (every request then fails; the server stays up).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ortpa.runtime.engine import Engine, UnknownRequest
from ortpa.runtime.sampling import SamplingParams
from ortpa.serve.metrics import ServeMetrics

__all__ = ["EngineBridge", "Refused", "ShuttingDown", "TokenEvent"]

log = logging.getLogger("ortpa.serve")

# While steps run, gauges are refreshed after a step that admitted, finished or aborted a request, else at most
# this often (counting cached blocks walks the prefix cache); and whenever the engine goes idle.
_PUBLISH_EVERY_S = 0.05


@dataclass(frozen=True)
class TokenEvent:
    token_ids: tuple[int, ...]
    finish_reason: str | None  # None while running
    logprobs: tuple | None = None  # TokenLogprobs per token, when the request asked
    prompt_logprobs: tuple | None = None  # once, with the first event, when the request asked


class ShuttingDown(RuntimeError):
    """A request submitted after the server began to stop."""


class Refused(Exception):
    """The engine refused request ``index`` of a batch (``cause``: what it raised); none of the batch was queued."""

    def __init__(self, index: int, cause: Exception) -> None:
        super().__init__(f"request {index}: {cause}")
        self.index = index
        self.cause = cause


@dataclass
class _Live:
    loop: asyncio.AbstractEventLoop
    sink: asyncio.Queue  # receives (request_id, TokenEvent | Exception)
    submitted: float
    last: float | None = None
    tokens: int = 0


class EngineBridge:
    """Drives ``engine`` in its own thread; ``submit`` and ``abort`` are safe from the event loop."""

    def __init__(self, engine: Engine, metrics: ServeMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._live: dict[str, _Live] = {}  # driving thread only
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._ids = 0
        self._published = 0.0
        self._changed = False  # a request came, went or was aborted since the gauges were last set

    # -- lifecycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ortpa-engine", daemon=True)
                self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Abort what is left (streams end with ``"abort"``) and join the thread."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def stopping(self) -> bool:
        """Stopped, stopping, or its thread died: no new request will run."""
        died = self._thread is not None and not self._thread.is_alive()
        return self._stop.is_set() or died

    # -- requests -------------------------------------------------------------------------------------
    async def submit(self, prompt_ids: Sequence[int], params: SamplingParams, sink: asyncio.Queue) -> str:
        """Queue one request whose ``(request_id, TokenEvent | Exception)`` items go to ``sink``; its id.

        Raises what ``Engine.add_request`` raises (too long for the model or the pool, ids out of the
        vocabulary), or :class:`ShuttingDown`.
        """
        try:
            (request_id,) = await self.submit_all([(prompt_ids, params)], sink)
        except Refused as exc:
            raise exc.cause from None
        return request_id

    async def submit_all(
        self, requests: Sequence[tuple[Sequence[int], SamplingParams]], sink: asyncio.Queue
    ) -> list[str]:
        """Queue several requests at once (all or none: one round trip to the engine's thread, one step's wait
        at most); their ids. :class:`Refused` names the first the engine refused; :class:`ShuttingDown`."""
        self.start()
        if self._stop.is_set():
            raise ShuttingDown("the server is shutting down")
        loop = asyncio.get_running_loop()
        done: concurrent.futures.Future = concurrent.futures.Future()
        batch = []
        for prompt, params in requests:
            self._ids += 1
            batch.append((f"r{self._ids}", list(prompt), params))
        self._commands.put(("add", batch, loop, sink, done))
        self._wake.set()
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:  # the caller is gone: what gets added is aborted right after (FIFO)
            for request_id, _, _ in batch:
                self.abort(request_id)
            raise
        return [request_id for request_id, _, _ in batch]

    def abort(self, request_id: str, reason: str = "abort") -> None:
        """Stop a request (``reason`` labels it in the metrics: ``"stop"`` when a stop string ended it)."""
        self._commands.put(("abort", request_id, reason))
        self._wake.set()

    # -- the driving thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._wake.clear()
                self._take_commands()
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._publish()
                    self._wake.wait(0.5)
        finally:
            self._take_commands()
            for request_id in list(self._live):
                self._deliver(request_id, TokenEvent((), "abort"))
                self._engine_abort(request_id)
            self._publish()

    def _take_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            else:
                self._engine_abort(command[1], command[2])

    def _add(self, batch: list, loop: asyncio.AbstractEventLoop, sink: asyncio.Queue, done) -> None:
        if self._stop.is_set():
            done.set_exception(ShuttingDown("the server is shutting down"))
            return
        added = []
        for index, (request_id, prompt, params) in enumerate(batch):
            try:
                self.engine.add_request(prompt, params, request_id=request_id)
            except Exception as exc:
                for other in added:  # all or none: nothing of a refused request stays queued
                    self.engine.abort(other)
                done.set_exception(Refused(index, exc))
                return
            added.append(request_id)
        now = time.perf_counter()
        for request_id, prompt, _ in batch:
            self._live[request_id] = _Live(loop, sink, now)
            if self.metrics is not None:
                self.metrics.prompt_tokens.inc(len(prompt))
        self._changed = True
        done.set_result(None)

    def _engine_abort(self, request_id: str, reason: str = "abort") -> None:
        if self._live.pop(request_id, None) is None:
            return  # finished meanwhile
        try:
            self.engine.abort(request_id)
        except UnknownRequest:  # the engine retired it in a step that then failed: nothing left to free
            pass
        self._changed = True
        if self.metrics is not None:
            self.metrics.finished.labels(reason).inc()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a failing step fails every request in it; the server stays up
            log.exception("engine step failed; failing %d request(s)", len(self._live))
            for request_id in list(self._live):
                live = self._live[request_id]
                self._engine_abort(request_id)
                _put(live, request_id, exc)
            return
        now = time.perf_counter()
        m = self.metrics
        # gauges first: a client reading /metrics after its token arrived sees the step that produced it
        if self._changed or any(o.finished for o in outputs) or now - self._published >= _PUBLISH_EVERY_S:
            self._publish()
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            if m is not None and out.new_token_ids:
                m.generated_tokens.inc(len(out.new_token_ids))
                if live.last is None:
                    m.ttft.observe(now - live.submitted)
                else:
                    m.itl.observe(now - live.last)
            live.last = now
            live.tokens += len(out.new_token_ids)
            event = TokenEvent(out.new_token_ids, out.finish_reason, out.logprobs, out.prompt_logprobs)
            self._deliver(out.request_id, event)
            if out.finished:
                del self._live[out.request_id]
                if m is not None:
                    m.finished.labels(out.finish_reason or "stop").inc()

    def _deliver(self, request_id: str, event: TokenEvent) -> None:
        live = self._live.get(request_id)
        if live is not None:
            _put(live, request_id, event)

    def _publish(self) -> None:
        m = self.metrics
        if m is None:
            return
        self._published = time.perf_counter()
        self._changed = False
        sched = self.engine.scheduler
        m.running.set(len(sched.running))
        m.waiting.set(len(sched.waiting))
        m.blocks_used.set(self.engine.num_blocks - self.engine.num_available_blocks)


def _put(live: _Live, request_id: str, item: Any) -> None:
    try:
        live.loop.call_soon_threadsafe(live.sink.put_nowait, (request_id, item))
    except RuntimeError:  # the loop closed (server gone): nobody is listening
        pass
