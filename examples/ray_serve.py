"""Serve one converted model from N replicas with Ray Serve: the ``ortpa serve`` app in each, one Engine each.

Each replica is a Ray actor holding a whole copy of the model: its ONNX Runtime session (the weights), its KV
pool, its tokenizer and its own engine thread; Ray Serve's proxy spreads requests over the replicas (it routes
each to the less busy of two), so throughput grows with replicas while each request runs on one machine.
A model must therefore fit one replica's machine; models larger than that need their layers split into stages
across machines (pipeline parallelism), which this does not do.

On one machine (a local Ray cluster is started)::

    python examples/ray_serve.py out/paged.onnx --replicas 2 --port 8000

Across machines: ``ray start --head`` on one, ``ray start --address HEAD:6379`` on the others (each with ortpa
installed with the serve extra, and the model at the same path), then on the head::

    python examples/ray_serve.py /models/paged.onnx --address auto --replicas 4 --host 0.0.0.0

Clients call ``http://HEAD:8000/v1`` exactly as they call ``ortpa serve``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from ray import serve

__all__ = ["OrtpaReplica", "build", "main"]


@serve.deployment
@serve.ingress()
class OrtpaReplica:
    """One replica: what ``ortpa serve`` holds, built where Ray places the actor."""

    def __init__(self, model: str, options: dict[str, Any]) -> None:
        from ortpa.serve.model import ServingModel

        opts = dict(options)
        self._api = {k: opts.pop(k) for k in ("api_key", "max_queue", "limits") if k in opts}
        self._served = ServingModel.load(model, **opts)

    def __serve_build_asgi_app__(self):
        from ortpa.serve.app import build_app

        app = build_app(self._served, **self._api)
        pid = str(os.getpid())

        @app.middleware("http")
        async def _replica(request, call_next):  # which replica answered: for logs and the test
            response = await call_next(request)
            response.headers["x-ortpa-replica"] = pid
            return response

        return app


def build(
    model: str,
    *,
    replicas: int = 2,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    served_model_name: str | None = None,
    **options: Any,
):
    """The Ray Serve application: ``replicas`` copies of the server for ``model`` (a path every node can read).

    ``options`` go to :meth:`ortpa.serve.model.ServingModel.load` (``num_blocks``, ``kv_budget_bytes``,
    ``block_size``, ``max_num_seqs``, ``provider``...) and to the app (``api_key``, ``max_queue``, ``limits``: a
    :class:`~ortpa.serve.limits.ServeLimits`, each replica enforcing it on its own requests).
    """
    deployment = OrtpaReplica.options(
        num_replicas=replicas,
        ray_actor_options={"num_cpus": num_cpus, "num_gpus": num_gpus},
        max_ongoing_requests=(options.get("max_num_seqs", 64) + options.get("max_queue", 256)),
    )
    return deployment.bind(model, {"name": served_model_name or model, **options})


def main(argv: list[str] | None = None) -> int:
    import ray

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="the converted model (file or folder), at the same path on every node")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--address", default=None, help="a running Ray cluster ('auto'); default: start a local one")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica")
    p.add_argument("--num-gpus", type=float, default=0.0, help="GPUs per replica (use --provider cuda with 1)")
    p.add_argument("--provider", choices=["cpu", "cuda"], default=None)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    args = p.parse_args(argv)

    ray.init(address=args.address)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = build(
        os.path.abspath(args.model) if os.path.exists(args.model) else args.model,
        replicas=args.replicas,
        num_cpus=args.num_cpus,
        num_gpus=args.num_gpus,
        served_model_name=args.served_model_name,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        provider=args.provider,
    )
    serve.run(app, name="ortpa", route_prefix="/")
    print(f"serving on http://{args.host}:{args.port}/v1 with {args.replicas} replicas; Ctrl-C stops", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
