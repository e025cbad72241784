"""``ortpa serve``: an OpenAI-compatible HTTP server over the continuous-batching Engine.

Modules: :mod:`~ortpa.serve.protocol` (request bodies, error shape), :mod:`~ortpa.serve.detokenizer`
(incremental text with stop strings), :mod:`~ortpa.serve.chat` (chat templates), :mod:`~ortpa.serve.metrics`
(Prometheus), :mod:`~ortpa.serve.bridge` (the engine's driving thread), :mod:`~ortpa.serve.generation` (one
request's choices), :mod:`~ortpa.serve.model` (what one server holds), :mod:`~ortpa.serve.limits` (what a request
may send) with :mod:`~ortpa.serve.guards` and :mod:`~ortpa.serve.prompts` (prompts tokenized off the event loop),
:mod:`~ortpa.serve.app` (the routes), :mod:`~ortpa.serve.server` (uvicorn with a draining SIGTERM). Needs the
``serve`` extra (:class:`~ortpa.serve.limits.ServeLimits` alone does not).
"""

from __future__ import annotations

__all__ = ["ServeLimits", "ServingModel", "build_app", "run_server"]


def __getattr__(name: str):  # the serve extra (fastapi, uvicorn) is imported only when asked for
    if name == "build_app":
        from ortpa.serve.app import build_app

        return build_app
    if name == "ServeLimits":
        from ortpa.serve.limits import ServeLimits

        return ServeLimits
    if name == "ServingModel":
        from ortpa.serve.model import ServingModel

        return ServingModel
    if name == "run_server":
        from ortpa.serve.server import run_server

        return run_server
    raise AttributeError(name)
