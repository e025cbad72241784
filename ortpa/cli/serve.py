"""``ortpa serve``: an OpenAI-compatible HTTP server over the Engine (needs the ``serve`` extra)."""

from __future__ import annotations

import argparse
import sys

from ortpa.cli._common import COMMANDS, EXIT_OK, MODEL_HELP, add_common, add_pipeline_options, add_revision
from ortpa.errors import InvalidParameter, Unavailable
from ortpa.serve.limits import ServeLimits

__all__ = ["register", "run"]


def _bounded(kind, low, high=None, what=None):
    what = what or f"a {kind.__name__} >= {low}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


def _positive(kind):
    return _bounded(kind, 1 if kind is int else 1e-9, what=f"a positive {kind.__name__}")


def run(args: argparse.Namespace) -> int:
    from ortpa.extras import require_extra

    require_extra("serve", "ortpa serve")
    # bound before the model loads (or converts), and held: a taken port is said at once, and no other process
    # can take it while the model loads; --port 0 takes a free one
    sock = _bind(args.host, args.port)
    try:
        return _serve(args, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, sock) -> int:
    from ortpa.cli.serve_source import serving_source
    from ortpa.serve.model import ServingModel
    from ortpa.serve.server import run_server

    model = serving_source(args.model, args.revision, cache_dir=args.cache_dir, quiet=args.quiet, options=[])
    revision = args.revision if model == args.model else None  # a cache entry is a plain folder
    if args.quiet:
        log_level = "error"
    else:
        log_level = "info" if args.verbose else "warning"
        print(f"ortpa serve: loading {model}", file=sys.stderr, flush=True)
    served = ServingModel.load(
        model,
        revision=revision,
        tokenizer=args.tokenizer,
        name=args.served_model_name or args.model,
        num_blocks=args.num_blocks,
        kv_budget_bytes=None if args.kv_memory is None else int(args.kv_memory * (1 << 30)),
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        provider=args.provider,
        threads=args.threads,
        ray_address=args.ray_address,
        placement=args.placement,
        micro_batches=args.micro_batches,
    )
    if args.max_model_len is not None:
        served.limit_context(args.max_model_len)
    port = sock.getsockname()[1]
    if not args.quiet or args.port == 0:  # a port the system picked is the one thing a caller must learn
        print(
            f"ortpa serve: {served.name!r} on http://{args.host}:{port}/v1 ({served.engine.num_blocks} KV blocks "
            f"of {args.block_size}, context {served.max_model_len or 'bounded by the pool'}, "
            f"chat template: {'yes' if served.chat_template else 'no'})",
            file=sys.stderr,
            flush=True,
        )
    try:
        run_server(
            served,
            sock=sock,
            api_key=args.api_key,
            max_queue=args.max_queue,
            limits=ServeLimits(
                max_body_bytes=args.max_body_bytes,
                max_prompt_bytes=args.max_prompt_bytes,
                max_n=args.max_n,
                max_concurrent_per_key=args.max_concurrent_per_key,
            ),
            drain_s=args.drain_timeout,
            log_level=log_level,
            access_log=not (args.no_access_log or args.quiet),  # --quiet: errors only
        )
    finally:
        served.engine.close()  # after the drain: a stage folder's Ray actors stop with the server
    return EXIT_OK


def _port_message(host: str, port: int, what: str) -> str:
    return f"--port {port}: {host}:{port} {what} (another server?); stop it, or pass another --port"


def _bind(host: str, port: int):
    """A socket bound to ``host:port`` as uvicorn binds one (``SO_REUSEADDR``), for the server to listen on;
    :class:`~ortpa.errors.Unavailable` when it cannot be bound."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise InvalidParameter("ortpa serve", "--host", "an address of this machine", host) from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise Unavailable(_port_message(host, port, "is already in use")) from None
        if exc.errno == errno.EADDRNOTAVAIL:
            raise InvalidParameter("ortpa serve", "--host", "an address of this machine", host) from None
        raise Unavailable(_port_message(host, port, f"cannot be bound: {exc.strerror}")) from None
    return sock


def register(sub) -> None:
    p = sub.add_parser(
        "serve",
        help=COMMANDS["serve"],
        description="Continuous batching over one Engine; /v1/completions, /v1/chat/completions (streamed as "
        "Server-Sent Events or not), /v1/models, /health, /metrics (Prometheus). The tokenizer.json, "
        "tokenizer_config.json (chat template), generation_config.json (EOS) and config.json (context length) "
        "beside the model are used. SIGTERM drains in-flight requests, then exits.",
        epilog="examples:\n  ortpa serve out/paged.onnx --port 8000\n"
        "  ortpa serve meta-llama/Llama-3.2-1B   (from the local HF cache: converted once, reused after)\n"
        "  ortpa serve out/ --served-model-name tiny --api-key secret --kv-memory 2\n"
        "  curl localhost:8000/v1/completions -H 'Content-Type: application/json' "
        '-d \'{"model": "tiny", "prompt": "Hello", "max_tokens": 8}\'',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        help="a converted (paged) ONNX model, or what to convert once into --cache-dir first: a dense ONNX "
        "model, a Hugging Face checkpoint folder, or ORG/NAME in the local hub cache" + MODEL_HELP,
    )
    add_revision(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    p.add_argument(
        "--port",
        type=_bounded(int, 0, 65535, "a port number 0..65535"),
        default=8000,
        help="0: a free port the system picks, printed in the 'on http://...' line (also with --quiet)",
    )
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL as given)")
    p.add_argument("--tokenizer", default=None, help="folder with the tokenizer files (default: the model's)")
    p.add_argument("--provider", choices=["cpu", "cuda"], default=None, help="default: CUDA if present, else CPU")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=_positive(int), default=None, help="KV pool size in blocks")
    pool.add_argument(
        "--kv-memory", type=_positive(float), default=None, help="KV pool size in GiB (default: 0.25 GiB)"
    )
    p.add_argument("--block-size", type=_positive(int), default=16)
    p.add_argument("--max-num-seqs", type=_positive(int), default=64, help="requests running at once")
    p.add_argument(
        "--max-num-batched-tokens",
        type=_positive(int),
        default=None,
        help="tokens one step computes, prompt chunks and decodes together: larger for throughput, smaller so "
        "that running requests go on sooner while a long prompt is prefilled (default: the Engine's, 1024)",
    )
    add_pipeline_options(p)
    p.add_argument(
        "--max-queue",
        type=_bounded(int, 0),
        default=256,
        help="requests waiting beyond the running ones; past it: 503",
    )
    p.add_argument(
        "--threads",
        type=_positive(int),
        default=None,
        help="ONNX Runtime intra-op threads (default: one per core; 1 suits a machine busy with other work)",
    )
    p.add_argument(
        "--max-model-len",
        type=_positive(int),
        default=None,
        help="tokens per request, prompt + completion (default: the model's); longer requests get a 400",
    )
    p.add_argument(
        "--cache-dir",
        default=None,
        help="where conversions made for serving are kept (default: $ORTPA_CACHE_DIR or ~/.cache/ortpa/serve)",
    )
    p.add_argument("--no-access-log", action="store_true", help="no line per request on stderr (--quiet implies it)")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on the /v1 and tokenizer routes; repeat for several keys",
    )
    limits = p.add_argument_group("limits on what one request may send (docs/serve.md: 'Limits')")
    defaults = ServeLimits()
    limits.add_argument(
        "--max-body-bytes",
        type=_positive(int),
        default=defaults.max_body_bytes,
        help="request body size; past it: 413, refused before the body is read (default: 32 per token of the "
        "context, from 256 KiB to 2 MiB)",
    )
    limits.add_argument(
        "--max-prompt-bytes",
        type=_positive(int),
        default=defaults.max_prompt_bytes,
        help="UTF-8 bytes of a request's prompt text; past it: 400, before tokenizing (default: 16 per token of "
        "the context, at most 1 MiB)",
    )
    limits.add_argument(
        "--max-n",
        type=_positive(int),
        default=defaults.max_n,
        help="choices ('n') per request; past it: 400 (default: %(default)s)",
    )
    limits.add_argument(
        "--max-concurrent-per-key",
        type=_positive(int),
        default=defaults.max_concurrent_per_key,
        help="requests one --api-key may have in flight; past it: 429 (default: %(default)s)",
    )
    p.add_argument("--drain-timeout", type=float, default=5.0, help="seconds SIGTERM lets in-flight requests finish")
    add_common(p)
    p.set_defaults(func=run)
