"""``ortpa export``: a Hugging Face model (local folder or config) -> dense ONNX, then converted."""

from __future__ import annotations

import argparse
import json

from ortpa.cli._common import COMMANDS, EXIT_OK, add_common, add_providers, progress_printer

__all__ = ["add_export_options", "export_from_args", "register", "run"]


def run(args: argparse.Namespace) -> int:
    from ortpa.extras import require_extra

    require_extra("export", "ortpa export")
    dense = args.output if args.dense_only else args.output + ".dense.onnx"
    if not args.dense_only and not args.random_weights:
        from ortpa.export.checkpoint_dtype import default_export_dtype, refuse_cpu_bfloat16, stored_dtype

        refuse_cpu_bfloat16(args.model, default_export_dtype(stored_dtype(args.model), args.dtype), args.providers)
    progress = progress_printer(args)
    info = export_from_args(args, args.model, dense, dtype=args.dtype, random_weights=args.random_weights)
    if not args.dense_only:
        from ortpa.deploy.deployment import convert_file  # verified, + genai_config.json beside it

        convert_file(
            dense,
            args.output,
            dtype=args.convert_dtype,
            progress=progress,
            providers=args.providers,
            verify=not args.no_verify,
        )
    if args.json:
        print(json.dumps({"dense": dense, "output": args.output, "info": dict(info)}, default=str))
    elif not args.quiet:
        print(f"wrote {dense}" + ("" if args.dense_only else f" and {args.output}"))
    return EXIT_OK


def export_from_args(args: argparse.Namespace, model, dense: str, *, dtype: str | None, random_weights: bool):
    """``export_hf`` with the export options of :func:`add_export_options` as parsed (``ortpa export`` and
    ``ortpa convert HF_DIR``); its :class:`~ortpa.export.hf.ExportInfo`."""
    from ortpa.export.hf import export_hf

    return export_hf(
        model,
        dense,
        random_weights=random_weights,
        opset=args.opset,
        attn_implementation=args.attn_implementation,
        experts=args.experts,
        dtype=dtype,
        external_data=True if args.external_data else None,
        progress=progress_printer(args),
        verbose=args.verbose,
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


def register(sub) -> None:
    p = sub.add_parser(
        "export",
        help=COMMANDS["export"],
        description="Export with torch.onnx.export(dynamo=True) and convert. Needs the `export` extra. "
        "No downloads: MODEL is a local model directory (safetensors, sharded or not) or a config.json "
        "(use --random-weights). MoE layers export through transformers' grouped_mm lowering, DeepSeek-V2's "
        "complex RoPE as its real-valued equivalent. A failed export is one line naming the op; --verbose "
        "shows the traceback.",
        epilog="examples:\n  ortpa export ./deepseek-tiny/config.json paged.onnx --random-weights\n"
        "  ortpa export ./DeepSeek-V2-Lite paged.onnx --export-dtype float32 --dtype float16",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="local Hugging Face model directory or config.json")
    p.add_argument("output", help="paged model path (the dense export is written next to it)")
    p.add_argument("--random-weights", action="store_true", help="seeded random weights from the config")
    add_export_options(p)
    p.add_argument(
        "--dtype",
        dest="convert_dtype",
        choices=["float16", "bfloat16"],
        default=None,
        help="convert the paged model to this dtype (as `ortpa convert --dtype`)",
    )
    p.add_argument("--dense-only", action="store_true", help="write only the dense export to OUTPUT")
    add_providers(p)
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="write the paged model without running it against the dense export first (as `ortpa convert "
        "--no-verify`: for a model this machine cannot run, e.g. bfloat16 on CPU)",
    )
    p.add_argument("--json", action="store_true")
    add_common(p)
    p.set_defaults(func=run)
