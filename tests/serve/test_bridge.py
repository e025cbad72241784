"""The engine's driving thread, with a scripted stand-in engine: errors reach the right requests, aborts free."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from ortpa.errors import InvalidRequest
from ortpa.runtime.engine import RequestOutput
from ortpa.serve.bridge import EngineBridge, Refused, ShuttingDown, TokenEvent
from ortpa.serve.metrics import ServeMetrics


@dataclass
class _Scheduler:
    running: list = field(default_factory=list)
    waiting: list = field(default_factory=list)


class FakeEngine:
    """Each request yields token 7 for ``max_new_tokens`` steps; ``fail_next`` makes the next step raise."""

    num_blocks = 10

    def __init__(self) -> None:
        self.requests: dict[str, list[int]] = {}  # id -> [remaining]
        self.scheduler = _Scheduler()
        self.aborted: list[str] = []
        self.fail_next = False

    @property
    def num_available_blocks(self) -> int:
        return self.num_blocks - len(self.requests)

    def add_request(self, prompt, params, request_id):
        if not prompt:
            raise InvalidRequest("empty prompt")
        self.requests[request_id] = [params.max_new_tokens]

    def abort(self, request_id):
        self.aborted.append(request_id)
        del self.requests[request_id]

    def has_unfinished(self):
        return bool(self.requests)

    def step(self):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device lost")
        outs = []
        for rid, left in list(self.requests.items()):
            left[0] -= 1
            done = left[0] == 0
            outs.append(RequestOutput(rid, (7,), done, "length" if done else None))
            if done:
                del self.requests[rid]
        return outs


def _params(n: int):
    from ortpa.runtime.sampling import SamplingParams

    return SamplingParams(max_new_tokens=n)


async def _drain(sink: asyncio.Queue, count: int) -> list:
    return [await asyncio.wait_for(sink.get(), 10) for _ in range(count)]


def test_tokens_errors_and_aborts():
    engine = FakeEngine()
    metrics = ServeMetrics(engine.num_blocks)
    bridge = EngineBridge(engine, metrics)

    async def scenario():
        sink: asyncio.Queue = asyncio.Queue()
        rid = await bridge.submit([1, 2], _params(3), sink)
        items = await _drain(sink, 3)
        assert items == [(rid, TokenEvent((7,), None))] * 2 + [(rid, TokenEvent((7,), "length"))]
        bridge.abort(rid)  # after it finished: nothing happens

        with pytest.raises(InvalidRequest):  # the engine's refusal reaches the submitter
            await bridge.submit([], _params(3), sink)
        with pytest.raises(Refused) as refused:  # all or none: the first, accepted, is taken back
            await bridge.submit_all([([1], _params(50)), ([], _params(3)), ([2], _params(3))], sink)
        assert refused.value.index == 1 and isinstance(refused.value.cause, InvalidRequest)
        assert not engine.requests and len(engine.aborted) == 1
        engine.aborted.clear()

        engine.fail_next = True  # a failing step fails the requests in flight, and only them
        failed = await bridge.submit([1], _params(5), sink)
        ((who, error),) = await _drain(sink, 1)
        assert who == failed and isinstance(error, RuntimeError) and "device lost" in str(error)
        assert failed in engine.aborted and not engine.requests
        ok = await bridge.submit([1], _params(1), sink)
        assert await _drain(sink, 1) == [(ok, TokenEvent((7,), "length"))]  # the bridge still serves

        cut = await bridge.submit([1], _params(10_000), sink)
        await _drain(sink, 1)
        bridge.abort(cut)
        for _ in range(200):  # the abort lands between two steps
            if cut in engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert cut in engine.aborted and not engine.requests

        last = await bridge.submit([1], _params(10_000), sink)
        await _drain(sink, 1)
        await asyncio.to_thread(bridge.stop)  # stopping ends the stream with "abort"
        rest = []
        while not sink.empty():
            rest.append(sink.get_nowait())
        assert rest[-1] == (last, TokenEvent((), "abort")) and last in engine.aborted
        with pytest.raises(ShuttingDown):
            await bridge.submit([1], _params(1), sink)

    try:
        asyncio.run(scenario())
    finally:
        bridge.stop()
    text = metrics.render().decode()
    assert 'ortpa_requests_finished_total{finish_reason="abort"} 3.0' in text  # failed, cut, last
    assert "ortpa_kv_blocks_used 0.0" in text and "ortpa_requests_running 0.0" in text
