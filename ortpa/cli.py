"""The ``ortpa`` console script.

Exit codes (DESIGN.md): 0 success, 1 the model or input is invalid (diagnostics printed), 2 usage errors.
Errors print without a traceback unless ``--verbose`` is given.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Sequence

from ortpa.errors import OrtpaError

__all__ = ["main"]

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2

_EPILOG = """examples:
  ortpa validate model.onnx --backend cuda
  ortpa validate model.onnx --json
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 on usage errors; keep that, shorter text
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true", help="show tracebacks and debug detail")
    p.add_argument("--quiet", action="store_true", help="print only errors and the final result")


# --------------------------------------------------------------------------------------------- validate
def _cmd_validate(args: argparse.Namespace) -> int:
    from ortpa.ops.validate import validate_model

    report = validate_model(args.model, backend=args.backend)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif not args.quiet or not report.ok:
        print(report.format())
    return EXIT_OK if report.ok else EXIT_INVALID


def _register_validate(sub) -> None:
    p = sub.add_parser(
        "validate",
        help="check every PagedAttention node of a model against ONNX Runtime's rules",
        description="Validate each com.microsoft::PagedAttention node from its declared types and shapes. "
        "Rules that depend on an unknown (symbolic) dimension are reported as unchecked, never as passed.",
        epilog="example:\n  ortpa validate paged.onnx --backend cuda --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="path to an .onnx file")
    p.add_argument("--backend", choices=["cuda", "webgpu", "portable"], default=None,
                   help="also check that this backend implements every feature the nodes use")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_common(p)
    p.set_defaults(func=_cmd_validate)


_REGISTRARS: list[Callable] = [_register_validate]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="ortpa",
        description="Convert dense-attention ONNX LLMs to paged-KV models on ONNX Runtime's "
        "com.microsoft::PagedAttention, prove them correct, and run them.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from ortpa import __version__

    parser.add_argument("--version", action="version", version=f"ortpa {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for register in _REGISTRARS:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except OrtpaError as exc:
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"ortpa {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except FileNotFoundError as exc:
        print(f"ortpa {args.command}: error: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return EXIT_INVALID
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
