"""``ortpa export``: a Hugging Face model (local folder or config) -> dense ONNX, written where OUTPUT says."""

from __future__ import annotations

import argparse
import json

from ortpa.cli._common import COMMANDS, EXIT_OK, add_common, progress_printer

__all__ = ["add_export_options", "export_options", "register", "run"]


def run(args: argparse.Namespace) -> int:
    from ortpa.conversion import export_dense

    info = export_dense(
        args.model,
        args.output,
        export_options(args, dtype=args.dtype),
        random_weights=args.random_weights,
        progress=progress_printer(args),
    )
    if args.json:
        print(json.dumps({"output": args.output, "info": dict(info)}, default=str))
    elif not args.quiet:
        print(f"wrote {args.output} (dense: past/present KV); convert it with `ortpa convert {args.output} OUT`")
    return EXIT_OK


def export_options(args: argparse.Namespace, *, dtype: str | None):
    """The export options of :func:`add_export_options` as parsed (``ortpa export`` and ``ortpa convert HF_DIR``)."""
    from ortpa.conversion import ExportOptions

    return ExportOptions(
        opset=args.opset,
        attn_implementation=args.attn_implementation,
        experts=args.experts,
        dtype=dtype,
        external_data=True if args.external_data else None,
        verbose=args.verbose,
        trace_every_layer=args.trace_every_layer,
    )


def add_export_options(p, dtype_dest: str = "dtype") -> None:
    p.add_argument("--opset", type=int, default=18)
    p.add_argument("--attn-implementation", choices=["sdpa", "eager"], default="sdpa")
    p.add_argument(
        "--experts",
        choices=["grouped_mm", "batched_mm"],
        default="grouped_mm",
        help="MoE experts implementation to export: grouped_mm (transformers' default; one MatMul per expert over "
        "its routed tokens) or batched_mm (gathers one weight matrix per token and expert: decode-sized only)",
    )
    p.add_argument(
        "--export-dtype",
        dest=dtype_dest,
        choices=["float32", "float16", "bfloat16"],
        default=None,
        help="dtype of the export (default: float16 for a bfloat16 or FP8 checkpoint, which then runs on CPU and "
        "CUDA; else as stored; float32 for --random-weights)",
    )
    p.add_argument(
        "--external-data", action="store_true", help="weights in OUTPUT.data (default: only past 1 GB of weights)"
    )
    p.add_argument(
        "--trace-every-layer",
        action="store_true",
        help="trace all decoder layers (default for a checkpoint: the first two of each kind, copied to the others "
        "once the two are shown to trace alike; docs/large_models.md)",
    )


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help=COMMANDS["export"],
        description="Export with torch.onnx.export(dynamo=True) to a dense ONNX model (past/present KV caches) at "
        "OUTPUT. Needs the `export` extra. No downloads: MODEL is a local model directory (safetensors, sharded or "
        "not) or a config.json (use --random-weights). MoE layers export through transformers' grouped_mm lowering, "
        "DeepSeek-V2's complex RoPE as its real-valued equivalent. A failed export is one line naming the op; "
        "--verbose shows the traceback. To export and convert in one step: `ortpa convert MODEL_DIR OUT`.",
        epilog="examples:\n  ortpa export ./deepseek-tiny/config.json dense.onnx --random-weights\n"
        "  ortpa export ./DeepSeek-V2-Lite dense.onnx --export-dtype float32\n"
        "  ortpa convert dense.onnx paged/model.onnx",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="local Hugging Face model directory or config.json")
    p.add_argument("output", help="where to write the dense ONNX model")
    p.add_argument("--random-weights", action="store_true", help="seeded random weights from the config")
    add_export_options(p)
    p.add_argument("--json", action="store_true")
    add_common(p)
    p.set_defaults(func=run)
