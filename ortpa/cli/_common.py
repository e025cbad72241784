"""What every ``ortpa`` command shares: exit codes, the parser class, common options, small argument types."""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import warnings
from collections.abc import Callable, Iterator

__all__ = [
    "COMMANDS",
    "EXIT_INTERRUPTED",
    "EXIT_INVALID",
    "EXIT_OK",
    "EXIT_UNAVAILABLE",
    "EXIT_USAGE",
    "MODEL_HELP",
    "Parser",
    "add_common",
    "add_pipeline_options",
    "add_providers",
    "add_revision",
    "library_logging",
    "progress_printer",
    "prompt_ids",
]

# one meaning each (README's synopsis and docs/cli.md list them; tests/test_cli_errors.py checks them)
EXIT_OK = 0  # done
EXIT_INVALID = 1  # the model or input is invalid, or a check failed (parity, validate): diagnostics printed
EXIT_USAGE = 2  # the command line cannot be carried out as given (argparse's own code)
EXIT_UNAVAILABLE = 3  # this machine lacks what the command needs: an optional extra, a free port
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT, as shells report it)

# every command, in the order of `ortpa --help`, with its one-line help: the CLI lists them without importing
# their modules (ortpa.cli.<name>), and imports only the one that runs
COMMANDS: dict[str, str] = {
    "demo": "the whole pipeline on a built-in DeepSeek-style MLA model (no downloads, no torch)",
    "convert": "convert a dense-attention ONNX model to a paged PagedAttention model",
    "validate": "check every PagedAttention node of a model against ONNX Runtime's rules",
    "split": "split a converted model by layers into pipeline stages (a stage folder, run by Ray)",
    "generate": "greedy generation with continuous batching on a converted model",
    "serve": "serve a converted model over HTTP with OpenAI's completions and chat API",
    "parity": "run the same prompts through the dense original and the converted model; compare",
    "export": "export a Hugging Face model (local dir or config) to dense ONNX (convert exports and converts)",
    "bench": "run the built-in benchmarks (ortpa.bench) and those in ./benchmarks; print one table",
    "doctor": "what this installation runs: onnxruntime, its providers, ortpa's native CPU kernel (path, ISA)",
}

MODEL_HELP = "; or a model folder, or a Hugging Face repo id ORG/NAME in the local cache (never downloaded)"


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 on usage errors; keep that, shorter text
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def add_revision(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--revision",
        default=None,
        help="branch, tag or commit of a Hugging Face repo id given as a model (default: main); offline",
    )


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """Where a stage folder's stages run (docs/distributed.md); ignored for a model file."""
    g = p.add_argument_group("a stage folder (`ortpa split`): each stage a Ray actor")
    g.add_argument(
        "--ray-address",
        default=None,
        help="join this Ray cluster (`ray start --head` prints it; 'auto' for the local one); default: $RAY_ADDRESS, "
        "else start a new local Ray instance with one CPU per stage",
    )
    g.add_argument(
        "--placement",
        choices=["pack", "spread", "strict-spread"],
        default="pack",
        help="stages on as few nodes as fit (pack), across nodes where possible (spread), or one per node",
    )
    g.add_argument(
        "--micro-batches",
        type=int,
        default=None,
        metavar="N",
        help="steps in flight at once, each of its own group of requests, so that the stages work at the same "
        "time (default: one per stage; 1: one step at a time)",
    )


def add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true", help="show tracebacks and debug detail")
    p.add_argument("--quiet", action="store_true", help="print only errors and the final result")


def _providers(text: str) -> tuple[str, ...]:
    names = tuple(dict.fromkeys(t.strip().lower() for t in text.split(",") if t.strip()))
    if not names or any(n not in ("cpu", "cuda") for n in names):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cpu,cuda, got {text!r}")
    return names


def add_providers(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--providers",
        type=_providers,
        default=("cpu", "cuda"),
        metavar="cpu,cuda",
        help="where the model is meant to run (default: cpu,cuda); the conversion opens it on each and refuses "
        "what cannot run there (CUDA is checked where this machine has a CUDA device)",
    )


@contextlib.contextmanager
def library_logging(verbose: bool) -> Iterator[None]:
    """Library chatter (onnxscript's, transformers', torch's logging, Python warnings, ONNX Runtime's warnings)
    on stderr with ``--verbose``, dropped otherwise, so that nothing comes between ortpa's own lines; ortpa's
    errors are its own one-line messages either way. Python's logging and warnings are restored on exit
    (``main`` may run many times in one process)."""
    import onnxruntime as ort

    # ONNX Runtime's own C++ log (warnings such as buffer re-use notes) is process-wide, with no getter to restore:
    # errors only, unless --verbose; its failures still reach ortpa as exceptions, said in one line
    ort.set_default_logger_severity(2 if verbose else 3)
    root = logging.getLogger()
    handler: logging.Handler = logging.NullHandler()
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s: %(levelname)s: %(message)s"))
    previous_level = root.level
    root.addHandler(handler)
    # ortpa's own one-time notice that the native library is absent is not library chatter: always on stderr
    native = logging.getLogger("ortpa.native")
    native_handler = logging.StreamHandler(sys.stderr)
    native_propagate, native.propagate = native.propagate, False
    native.addHandler(native_handler)
    if verbose:
        root.setLevel(min(previous_level or logging.WARNING, logging.INFO))
    with warnings.catch_warnings():
        if not verbose:
            warnings.simplefilter("ignore")
        try:
            yield
        finally:
            root.removeHandler(handler)
            root.setLevel(previous_level)
            native.removeHandler(native_handler)
            native.propagate = native_propagate


def progress_printer(args: argparse.Namespace) -> Callable[[str], None] | None:
    if args.quiet:
        return None
    return lambda message: print(f"  {message}", file=sys.stderr, flush=True)


def prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"expected at least one non-negative token id, got {text!r}")
    return ids
