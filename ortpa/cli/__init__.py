"""The ``ortpa`` console script: one module per command (``register`` its parser, ``run`` it).

Exit codes (``ortpa.cli._common``): 0 success, 1 the model or input is invalid (diagnostics printed), 2 usage
errors, 3 this machine lacks what the command needs (an optional extra, a free port), 130 interrupted.
Errors print without a traceback unless ``--verbose`` is given. Each command's work lives in the package
(``rewriter``, ``runtime``, ``parity``, ``export``...); the command modules only parse and print.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import os
import sys
import threading
import traceback
from collections.abc import Sequence

from ortpa import __version__
from ortpa.cli._common import (
    COMMANDS,
    EXIT_INTERRUPTED,
    EXIT_INVALID,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    Parser,
    library_logging,
)
from ortpa.errors import OrtpaError, Unavailable

__all__ = ["build_parser", "entry", "main"]

_EPILOG = """examples:
  ortpa demo
  ortpa convert dense.onnx paged.onnx
  ortpa convert ./DeepSeek-V2-Lite paged.onnx      (a Hugging Face folder: export, then convert)
  ortpa validate paged.onnx --backend cuda
  ortpa generate paged.onnx --prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 8 --json
  ortpa generate paged.onnx --prompt "Hello" --max-new-tokens 32
  ortpa parity dense.onnx paged.onnx --prompt-ids 1,2,3
  ortpa serve paged.onnx --port 8000               (OpenAI-compatible HTTP server)
"""


def build_parser(command: str | None = None, *, every: bool = True) -> argparse.ArgumentParser:
    """The ``ortpa`` parser. ``every``: each command's own options (as the tests and docs read them); otherwise
    only ``command``'s, the others listed by name and help (``main``: starting a command imports its module
    alone, and ``ortpa --help`` / ``--version`` import none)."""
    parser = Parser(
        prog="ortpa",
        description="Convert dense-attention ONNX LLMs to paged-KV models on ONNX Runtime's "
        "com.microsoft::PagedAttention, prove them correct, and run them.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"ortpa {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, help_text in COMMANDS.items():
        if every or name == command:
            importlib.import_module(f"ortpa.cli.{name}").register(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # ortpa's own options take no value, so the command is the first word that is not an option
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command, every=False)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        with library_logging(getattr(args, "verbose", False)):
            return int(args.func(args))
    except OrtpaError as exc:  # ConversionError lists every failing layer with its reason
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"ortpa {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_UNAVAILABLE if isinstance(exc, Unavailable) else EXIT_INVALID
    except FileNotFoundError as exc:
        print(f"ortpa {args.command}: error: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:
        # ONNX Runtime's own exception types (Fail, InvalidGraph, ...) when it refuses a model that passed ortpa's
        # load checks (e.g. a corrupted constant): invalid input, said on one line; anything else is a bug
        if not type(exc).__module__.startswith("onnxruntime"):
            raise
        from ortpa.model.file import ort_message_line

        if getattr(args, "verbose", False):
            traceback.print_exc()
        models = " / ".join(
            str(getattr(args, k)) for k in ("input", "model", "original", "converted") if hasattr(args, k)
        )
        print(
            f"ortpa {args.command}: error: ONNX Runtime rejected {models}: {ort_message_line(str(exc))}",
            file=sys.stderr,
        )
        return EXIT_INVALID
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def entry() -> None:
    """The console script (and ``python -m ortpa``): :func:`main`, then the process ends without tearing down its
    modules one by one. After a conversion that teardown (torch, transformers and the graphs they left) took 1.5 s
    of an 11 s ``ortpa convert``; nothing in it writes anything. The interpreter's exit handlers still run (logging,
    temporary files, a Ray or multiprocessing shutdown) and the output streams are flushed; while a thread that
    is not a daemon is still running, the exit is the ordinary one (the interpreter waits for it)."""
    code = main()
    if any(t is not threading.main_thread() and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing left to flush into
            pass
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    entry()
