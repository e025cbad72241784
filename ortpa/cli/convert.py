"""``ortpa convert``: a dense model (or a Hugging Face checkpoint, exported first) -> a paged model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ortpa.cli._common import EXIT_OK, MODEL_HELP, add_common, add_revision, progress_printer
from ortpa.cli.export import add_export_options
from ortpa.errors import ConversionError, OrtpaError
from ortpa.tolerances import FAMILY_EXTRA_ATOL

__all__ = ["register", "run"]


def _convert_progress(args: argparse.Namespace):
    """A bar on a terminal, plain lines otherwise, nothing with --quiet (ortpa.cli.progress)."""
    if args.quiet:
        return None
    from ortpa.cli.progress import ConvertProgress

    return ConvertProgress(sys.stderr)


def _export_first(args: argparse.Namespace, folder: Path) -> str:
    """``convert HF_DIR OUT``: export the checkpoint ``folder`` to ``OUT.dense.onnx`` first; that file's path."""
    try:
        from ortpa.export.hf import export_hf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConversionError(
            f"{args.input} is a Hugging Face checkpoint: exporting it needs the export extra "
            f"(pip install 'ortpa[export]'): {exc}"
        ) from None
    progress = progress_printer(args)
    dense = args.output + ".dense.onnx"
    if progress:
        progress(f"[1/2] export {folder} -> {dense}")
    export_hf(
        folder,
        dense,
        random_weights=False,
        opset=args.opset,
        attn_implementation=args.attn_implementation,
        experts=args.experts,
        dtype=args.export_dtype,
        external_data=True if args.external_data else None,
        progress=progress,
        verbose=args.verbose,
    )
    if progress:
        progress(f"[2/2] convert {dense} -> {args.output}")
    return dense


def run(args: argparse.Namespace) -> int:
    from ortpa.model.ref import ModelRef, NoOnnxFile, companion_files, locate_model
    from ortpa.parity.convert_file import convert_file

    try:
        ref = locate_model(args.input, args.revision)
    except NoOnnxFile as exc:  # a Hugging Face checkpoint (config.json, no ONNX file): export it first
        if not (exc.folder / "config.json").is_file():
            raise
        try:
            ref = ModelRef(Path(_export_first(args, exc.folder)), exc.folder)
        except OrtpaError as err:  # one line: the folder was no ONNX model, and exporting it failed too
            raise ConversionError(f"{exc}; exporting it as a Hugging Face checkpoint failed: {err}") from err
    progress = _convert_progress(args)
    verified: list = []
    try:
        proto = convert_file(
            ref,
            args.output,
            dtype=args.dtype,
            rope_in_op=args.rope_in_op,
            logits=args.logits,
            kv_cache_dtype=args.kv_cache_dtype,
            absorb=args.absorb,
            attention_metadata=not args.no_attention_metadata,
            position_ids=args.position_ids,
            max_positions=args.max_positions,
            progress=progress,
            kv_scale=args.kv_scale,
            verify=not args.no_verify,
            family=args.family,
            on_verified=verified.append,
        )
    finally:
        if progress is not None:
            progress.close()
    nodes = sum(1 for n in proto.graph.node if n.op_type == "PagedAttention")
    copied = [name for name, _ in companion_files(ref.folder)] if ref.folder is not None else []
    result = {"input": str(ref.path), "output": args.output, "paged_attention_nodes": nodes, "copied": copied}
    result["verification"] = verified[0].summary() if verified else None
    if args.json:
        print(json.dumps(result))
    elif not args.quiet:
        also = f" (and copied {', '.join(copied)} beside it)" if copied else ""
        check = (
            f"; verified against the original: max |dlogit| {verified[0].parity.max_abs_logit_error:.2e}"
            if verified
            else "; NOT verified (--no-verify)"
        )
        print(f"wrote {args.output}: {nodes} PagedAttention node(s){also}{check}")
    return EXIT_OK


def register(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a dense-attention ONNX model to a paged PagedAttention model",
        description="Rewrite dense MLA attention (DeepSeek-style) into PagedAttention LATENT and MHA/GQA into "
        "SEPARATE, replace past/present KV by paged caches and index inputs, validate, and write atomically. "
        "The converted model is then run against the original (a few seeded prompts, a few greedy steps) before it is "
        "moved into place. The input is never modified; a model or layer that does not match, or a converted model "
        "that disagrees with the original, is reported and nothing is written.",
        epilog="examples:\n  ortpa convert dense.onnx paged.onnx\n"
        "  ortpa convert dense.onnx paged.onnx --dtype float16 --rope-in-op\n"
        "  ortpa convert ORG/NAME out/model.onnx --revision main   # a repo in the local Hugging Face cache",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "input",
        help="dense ONNX model (e.g. from `ortpa export` or torch.onnx.export)"
        + MODEL_HELP
        + "; a Hugging Face checkpoint folder (config.json and weights, no .onnx file) is exported to "
        "OUTPUT.dense.onnx first (needs the export extra)",
    )
    p.add_argument(
        "output",
        help="where to write the paged model (a regular file; a folder or repo input's tokenizer and config "
        "files are copied beside it)",
    )
    add_revision(p)
    p.add_argument(
        "--dtype",
        choices=["float16", "bfloat16"],
        default=None,
        help="convert the whole model; default keeps its precision and casts at the attention boundary",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["float16", "bfloat16", "int8", "float8e4m3fn"],
        default=None,
        help="element type of the KV caches (default: the op's float type). int8: static scales calibrated by "
        "running the dense model on seeded random prompts (see docs/converted_model.md); float8e4m3fn is "
        "rejected (ortpa's portable op cannot run it)",
    )
    p.add_argument(
        "--kv-scale",
        choices=["per-channel", "per-tensor"],
        default="per-channel",
        help="with --kv-cache-dtype int8: one scale per (kv head, channel) (default) or one per cache tensor",
    )
    p.add_argument("--rope-in-op", action="store_true", help="move RoPE into the op (do_rotary=1)")
    p.add_argument(
        "--logits",
        choices=["last", "all"],
        default="last",
        help="logits for each sequence's last new token (default) or for every packed token",
    )
    p.add_argument(
        "--absorb",
        choices=["auto", "fold", "matmul"],
        default="auto",
        help="MLA: fold W_UK/W_UV into q_proj/o_proj where exact and not larger (auto), always where exact "
        "(fold), or keep per-head MatMuls (matmul)",
    )
    p.add_argument(
        "--no-attention-metadata", action="store_true", help="do not add the host-side attention_metadata input"
    )
    p.add_argument(
        "--position-ids",
        choices=["derive", "input"],
        default="derive",
        help="derive positions in-graph from the sequence lengths (default) or take a position_ids input",
    )
    p.add_argument(
        "--max-positions",
        type=int,
        default=None,
        help="rows of the cos/sin tables with --rope-in-op (default: the model's, else 4096)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="write the model without running it against the original first. By default the converted model "
        "and the original run a few seeded prompts for a few greedy steps (one model in memory at a time) and "
        "nothing is written on a mismatch; skip it only for a model too large for this machine's memory to run",
    )
    p.add_argument(
        "--family",
        choices=sorted(FAMILY_EXTRA_ATOL),
        default=None,
        help="verification: a model family measured with larger logit error (default: from the input folder's "
        "config.json)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON (with the verification's figures)")
    add_export_options(p.add_argument_group("when INPUT is a Hugging Face folder"), dtype_dest="export_dtype")
    add_common(p)
    p.set_defaults(func=run)
