"""Run the app under uvicorn; SIGTERM (or Ctrl-C) drains: no new connections, in-flight requests finish for up
to ``drain_s`` seconds, then whatever still runs is aborted (its stream ends with ``finish_reason: "abort"``
and ``data: [DONE]``), and the process exits."""

from __future__ import annotations

import contextlib
import logging
import socket
import sys
import threading
from collections.abc import Iterator, Sequence

import uvicorn

from ortpa.serve.app import build_app
from ortpa.serve.limits import ServeLimits
from ortpa.serve.model import ServingModel

__all__ = ["run_server"]


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_drained, drain_s: float) -> None:
        super().__init__(config)
        self._on_drained = on_drained
        self._drain_s = drain_s
        self._timer: threading.Timer | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn re-raises the signal once shut down (exit status -15); a drained stop is a clean exit: 0
        with super().capture_signals():
            try:
                yield
            finally:
                captured = getattr(self, "_captured_signals", None)
                if isinstance(captured, list):
                    captured.clear()

    def handle_exit(self, sig, frame) -> None:
        if self._timer is None:
            print(f"ortpa serve: stopping; draining in-flight requests for up to {self._drain_s:g} s", file=sys.stderr)
            self._timer = threading.Timer(self._drain_s, self._on_drained)
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)


def run_server(
    served: ServingModel,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    api_key: str | Sequence[str] | None = None,
    max_queue: int = 256,
    limits: ServeLimits | None = None,
    drain_s: float = 5.0,
    log_level: str = "warning",
    access_log: bool = True,
) -> None:
    """Serve until SIGTERM; on ``sock`` (bound, not yet listening) when given, else on ``host:port``. ``api_key``,
    ``max_queue``, ``limits``, ``access_log``: as :func:`~ortpa.serve.app.build_app` takes them."""
    app = build_app(served, api_key=api_key, max_queue=max_queue, access_log=access_log, limits=limits)
    bridge = app.state.ortpa.bridge
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(drain_s) + 2,  # after the bridge's abort has ended every stream
        lifespan="on",
        access_log=False,  # ours (ortpa.serve.access_log) names the request id and its tokens
    )
    logging.getLogger("ortpa.serve").setLevel(log_level.upper())
    server = _DrainingServer(config, bridge.stop, drain_s)
    server.run(sockets=None if sock is None else [sock])
