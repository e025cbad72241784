"""``ortpa validate``: every PagedAttention node of a model against ONNX Runtime's rules and a backend."""

from __future__ import annotations

import argparse
import json

from ortpa.cli._common import COMMANDS, EXIT_INVALID, EXIT_OK, MODEL_HELP, add_common, add_revision
from ortpa.errors import InvalidModel

__all__ = ["register", "run"]


def run(args: argparse.Namespace) -> int:
    from ortpa.ops.validate import validate_model

    report = validate_model(args.model, backend=args.backend, revision=args.revision)
    if not report.nodes:  # nothing was checked: say why, never "OK"
        raise InvalidModel(report.source, _nothing_to_validate(report.source))
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    elif not args.quiet or not report.ok:
        print(report.format())
    return EXIT_OK if report.ok else EXIT_INVALID


def _nothing_to_validate(path: str) -> str:
    from ortpa.model.file import read_model
    from ortpa.model.kind import ModelKind, model_kind

    proto = read_model(path, copy=False, check_runtime=False, load_external_data=False).proto
    if model_kind(proto) is ModelKind.PORTABLE:
        return (
            "no PagedAttention node to validate: this file was lowered to standard ONNX ops by `ortpa convert "
            "--portable` (its nodes were validated before the lowering); validate the native conversion (convert "
            "without --portable), or check this file by running it (`ortpa generate`, `ortpa parity`)"
        )
    return (
        "no PagedAttention node to validate: a dense model (past/present KV); convert it first, "
        "`ortpa convert MODEL paged.onnx`, then validate paged.onnx"
    )


def register(sub) -> None:
    p = sub.add_parser(
        "validate",
        help=COMMANDS["validate"],
        description="Validate each com.microsoft::PagedAttention node from its declared types and shapes. "
        "Rules that depend on an unknown (symbolic) dimension are reported as unchecked, never as passed.",
        epilog="example:\n  ortpa validate paged.onnx --backend cuda --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="path to an .onnx file" + MODEL_HELP)
    add_revision(p)
    p.add_argument(
        "--backend",
        choices=["cuda", "webgpu", "portable"],
        default=None,
        help="also check that this backend implements every feature the nodes use",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_common(p)
    p.set_defaults(func=run)
