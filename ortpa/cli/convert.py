"""``ortpa convert``: a dense model (or a Hugging Face checkpoint, exported first) -> a paged model."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ortpa.cli._common import COMMANDS, EXIT_OK, MODEL_HELP, add_common, add_providers, add_revision
from ortpa.cli.export import add_export_options

__all__ = ["register", "run"]


def _convert_progress(args: argparse.Namespace):
    """A bar on a terminal, plain lines otherwise, nothing with --quiet (ortpa.cli.progress)."""
    if args.quiet:
        return None
    from ortpa.cli.progress import ConvertProgress

    return ConvertProgress(sys.stderr)


def _genai_options(args: argparse.Namespace):
    from ortpa.deploy.genai_config import DEFAULT_KV_BUDGET_BYTES, GenaiOptions

    return GenaiOptions(
        block_size=args.genai_block_size,
        max_batch_size=args.genai_max_batch_size,
        max_scheduled_tokens=args.genai_max_scheduled_tokens,
        kv_budget_bytes=int(args.genai_kv_budget_mb * 2**20) if args.genai_kv_budget_mb else DEFAULT_KV_BUDGET_BYTES,
        num_blocks=args.genai_num_blocks,
        gpu_utilization_factor=args.genai_gpu_utilization,
    )


def options_from_args(args: argparse.Namespace):
    """The command line as one :class:`~ortpa.conversion.ConvertOptions`."""
    from ortpa.cli.export import export_options
    from ortpa.conversion import ConvertOptions

    return ConvertOptions.of(
        dtype=args.dtype,
        rope_in_op=args.rope_in_op,
        logits=args.logits,
        kv_cache_dtype=args.kv_cache_dtype,
        absorb=args.absorb,
        mla_prefill=args.mla_prefill,
        attention_metadata=not args.no_attention_metadata,
        position_ids=args.position_ids,
        max_positions=args.max_positions,
        kv_scale=args.kv_scale,
        providers=args.providers,
        verify=not args.no_verify,
        portable=args.portable,
        if_free=args.if_free,
        genai=_genai_options(args),
        revision=args.revision,
        export=export_options(args, dtype=args.export_dtype),
        keep_dense=Path(args.keep_dense) if args.keep_dense else None,
    )


def _split_after(args: argparse.Namespace) -> None:
    """``--stages N``: the converted model split into ``<output>.stages`` by the code of ``ortpa split``."""
    from ortpa.cli.split import print_split
    from ortpa.stages import split_model

    result = split_model(args.output, f"{args.output}.stages", args.stages, verify=not args.no_verify)
    if not args.quiet and not args.json:
        print_split(result, False)


def _is_checkpoint(model: str) -> bool:
    """A local folder with config.json and no ONNX model: a Hugging Face checkpoint, exported by convert."""
    folder = Path(model)
    return folder.is_dir() and (folder / "config.json").is_file() and not any(folder.glob("*.onnx"))


def _stages_from_checkpoint(args: argparse.Namespace, options) -> int:
    """``--stages N`` on a checkpoint: the stage folder OUTPUT.stages written during the export, and no OUTPUT."""
    from ortpa.cli.split import print_split
    from ortpa.conversion.staged import convert_to_stages
    from ortpa.stages import SplitResult

    progress = _convert_progress(args)
    try:
        result = convert_to_stages(args.input, f"{args.output}.stages", args.stages, options, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    split = SplitResult(result.folder, result.manifest, result.proof)
    if args.json:
        v = result.verification
        print(
            json.dumps(
                {
                    "input": args.input,
                    "folder": str(result.folder),
                    "first_layers": list(result.placement.first_layers),
                    "stage_bytes": [s.weight_bytes for s in result.manifest.stages],
                    "copied": list(result.copied),
                    "verification": v.summary() if v else None,
                    "proof": None if result.proof is None else result.proof.__dict__,
                }
            )
        )
    elif not args.quiet:
        print_split(split, False)
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    from ortpa.conversion import convert_file

    options = options_from_args(args)
    if args.stages and _is_checkpoint(args.input):
        return _stages_from_checkpoint(args, options)
    progress = _convert_progress(args)
    try:
        result = convert_file(args.input, args.output, options, progress=progress)
    finally:
        if progress is not None:
            progress.close()
    if args.stages:
        _split_after(args)
    if args.json:
        print(
            json.dumps(
                {
                    "input": str(result.source),
                    "output": args.output,
                    "paged_attention_nodes": result.paged_attention_nodes,
                    "portable": result.portable is not None,
                    "split_latent": bool(result.portable and result.portable.split_latent),
                    "genai_config": str(result.genai_config),
                    "copied": list(result.copied),
                    "kv_cache_dtype": result.kv_cache_dtype,
                    "kv_cache_dtype_reason": result.kv_cache_dtype_reason,
                    "verification": result.verification.summary() if result.verification else None,
                    **(
                        {"mla_prefill": result.mla_prefill, "mla_prefill_reason": result.mla_prefill_reason}
                        if result.mla_prefill is not None
                        else {}
                    ),
                }
            )
        )
        return EXIT_OK
    if not result.eos_token_id and not args.quiet:
        # genai then ends every request at its default id 0: say so rather than let a deployment stop early
        where = (
            f"none of genai_config.json, config.json, generation_config.json in {result.metadata_folder} names one"
            if result.metadata_folder is not None
            else "no genai_config.json, config.json or generation_config.json beside the input"
        )
        print(
            f"ortpa convert: note: no eos_token_id found ({where}): genai_config.json has none, and onnxruntime-genai "
            'then stops at token id 0; add "eos_token_id" to its "model" section',
            file=sys.stderr,
        )
    if not args.quiet:
        copied = result.copied
        also = f" (and copied {', '.join(copied)} beside it)" if copied else ""
        kind = "lowered to standard ONNX ops (--portable)" if result.portable else "PagedAttention node(s)"
        v = result.verification
        check = (
            f"; verified against the original (float32 twin: max |d| / scale "
            f"{v.verdict.structure.max_relative_error:.1e}; {v.verdict.precision.dtype}: KL max "
            f"{v.verdict.precision.kl_max:.1e}, max |dlogit| {v.max_abs_logit_error:.2e})"
            if v is not None
            else "; NOT verified (--no-verify)"
        )
        print(f"wrote {args.output}: {result.paged_attention_nodes} {kind}, genai_config.json{also}{check}")
        print(f"KV cache: {result.kv_cache_dtype} ({result.kv_cache_dtype_reason})")
    return EXIT_OK


def register(sub) -> None:
    p = sub.add_parser(
        "convert",
        help=COMMANDS["convert"],
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
        "a temporary folder first (needs the export extra; --keep-dense DIR keeps it)",
    )
    p.add_argument(
        "output",
        help="where to write the paged model (a regular file; the input's tokenizer and config files, from its "
        "folder, are copied beside it)",
    )
    add_revision(p)
    add_providers(p)
    p.add_argument(
        "--dtype",
        choices=["float16", "bfloat16"],
        default=None,
        help="convert the whole model (float32, and bfloat16 for float16, become it); default keeps its precision "
        "and casts at the attention boundary",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "float16", "bfloat16", "int8", "float8e4m3fn"],
        default="auto",
        help="element type of the KV caches. auto (default): the model's activation dtype (--dtype, else the "
        "model's float16/bfloat16; a float32 model gets float16, the more precise of the two types "
        "PagedAttention computes in); float16/bfloat16 choose for a float32 model. int8: static scales calibrated "
        "by running the dense model on seeded random prompts (see docs/converted_model.md); float8e4m3fn is "
        "rejected (ortpa's portable op cannot run it). The summary and the model's metadata say what was picked",
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
        help="logits for each sequence's last new token, or for the tokens a step names in the optional "
        "logits_indices input (default; prompt scoring in one pass), or for every packed token",
    )
    p.add_argument(
        "--mla-prefill",
        choices=["expanded", "absorbed"],
        default="expanded",
        help="MLA: attend fresh prompts (no cached prefix) in the expanded form, 192/128 per head, and decodes and "
        "prefix-cached chunks absorbed (default; --json says why where it cannot apply), or keep every row "
        "absorbed (docs/mla_prefill.md)",
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
    p.add_argument("--json", action="store_true", help="print the result as JSON (with the verification's figures)")
    p.add_argument(
        "--stages",
        type=int,
        default=None,
        metavar="N",
        help="also split the converted model into N pipeline stages, in the folder OUTPUT.stages (as `ortpa split`). "
        "From a Hugging Face checkpoint folder, the stages are written during the export and OUTPUT itself is not: "
        "the model never exists as one file (each weight goes straight to its stage's data file); not with "
        "--portable or --keep-dense",
    )
    p.add_argument(
        "--portable",
        action="store_true",
        help="lower every PagedAttention node to standard ONNX ops (model-local functions) after validating it: "
        "plain ONNX Runtime runs the file on any execution provider, onnxruntime-genai's Engine on CPU; MLA "
        "(LATENT) caches are split into a key and a value half. Default: the native op (CUDA, WebGPU)",
    )
    p.add_argument(
        "--if-free",
        action="store_true",
        help="with --portable: the form without If (both attention groups at every step, padded so that nothing "
        "is empty), which the OpenVINO execution provider compiles; 1.2-1.7x slower on the CPU EP",
    )
    p.add_argument(
        "--keep-dense",
        metavar="DIR",
        default=None,
        help="when INPUT is a Hugging Face folder: keep the intermediate dense export in DIR (default: a "
        "temporary folder, removed after the conversion)",
    )
    g = p.add_argument_group("genai_config.json (onnxruntime-genai's engine.dynamic_batching)")
    g.add_argument("--genai-block-size", type=int, default=16, help="tokens per KV block (power of two >= 16)")
    g.add_argument("--genai-max-batch-size", type=int, default=16, help="requests genai runs at once (<= 256)")
    g.add_argument(
        "--genai-max-scheduled-tokens", type=int, default=256, help="tokens per step; smaller chunks prefills"
    )
    g.add_argument(
        "--genai-kv-budget-mb",
        type=float,
        default=None,
        help="--portable: KV pool memory genai allocates (default 256 MiB; never more blocks than "
        "max-batch-size full-context sequences need)",
    )
    g.add_argument("--genai-num-blocks", type=int, default=None, help="--portable: the pool size in blocks")
    g.add_argument(
        "--genai-gpu-utilization",
        type=float,
        default=0.6,
        help="native (CUDA) files: the share of free GPU memory genai gives the KV pool",
    )
    add_export_options(p.add_argument_group("when INPUT is a Hugging Face folder"), dtype_dest="export_dtype")
    add_common(p)
    p.set_defaults(func=run)
