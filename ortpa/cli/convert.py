"""``ortpa convert``: a dense model (or a Hugging Face checkpoint, exported first) -> a paged model."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

from ortpa.cli._common import EXIT_OK, MODEL_HELP, add_common, add_providers, add_revision, progress_printer
from ortpa.cli.export import add_export_options, export_from_args
from ortpa.errors import ConversionError, OrtpaError

__all__ = ["register", "run"]


def _convert_progress(args: argparse.Namespace):
    """A bar on a terminal, plain lines otherwise, nothing with --quiet (ortpa.cli.progress)."""
    if args.quiet:
        return None
    from ortpa.cli.progress import ConvertProgress

    return ConvertProgress(sys.stderr)


def _dense_folder(args: argparse.Namespace, stack: contextlib.ExitStack) -> Path:
    """Where ``convert HF_DIR OUT`` exports the dense model: ``--keep-dense DIR``, else a temporary folder next to
    the output (same disk), removed when the conversion ends: the output folder holds the deployment only."""
    if args.keep_dense:
        folder = Path(args.keep_dense)
        folder.mkdir(parents=True, exist_ok=True)
        return folder
    parent = Path(args.output).resolve().parent
    made = [p for p in (parent, *parent.parents) if not p.exists()]
    parent.mkdir(parents=True, exist_ok=True)
    for folder in reversed(made):  # last in, first out: on failure the innermost goes first, then those around it
        stack.push(lambda failed, *_, folder=folder: _remove_if_empty(folder) if failed else None)
    tmp = Path(tempfile.mkdtemp(prefix=".ortpa-dense.", dir=parent))
    stack.callback(shutil.rmtree, tmp, True)
    return tmp


def _remove_if_empty(folder: Path) -> None:
    with contextlib.suppress(OSError):
        folder.rmdir()


def _export_first(args: argparse.Namespace, folder: Path, dense_dir: Path) -> str:
    """``convert HF_DIR OUT``: export the checkpoint ``folder`` to ``dense_dir/model.onnx`` first; its path."""
    try:
        import ortpa.export.hf  # noqa: F401  (the export extra is there; else one line, below)
        from ortpa.export.checkpoint_dtype import default_export_dtype, refuse_cpu_bfloat16, stored_dtype
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConversionError(
            f"{args.input} is a Hugging Face checkpoint: exporting it needs the export extra "
            f"(pip install 'ortpa[export]'): {exc}"
        ) from None
    refuse_cpu_bfloat16(args.input, default_export_dtype(stored_dtype(folder), args.export_dtype), args.providers)
    progress = progress_printer(args)
    dense = str(dense_dir / "model.onnx")
    if progress:
        progress(f"[1/2] export {folder} -> {dense}")
    export_from_args(args, folder, dense, dtype=args.export_dtype, random_weights=False)
    if progress:
        progress(f"[2/2] convert {dense} -> {args.output}")
    return dense


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


def run(args: argparse.Namespace) -> int:
    from ortpa.deploy.deployment import check_portable_options, convert_deployment
    from ortpa.model.ref import ModelRef, NoOnnxFile, companion_files, locate_model

    genai = _genai_options(args)
    genai.check()  # bad deployment options: refused before any work
    if args.portable:
        check_portable_options(kv_cache_dtype=args.kv_cache_dtype)
    with contextlib.ExitStack() as stack:
        try:
            ref = locate_model(args.input, args.revision)
            if args.keep_dense:
                raise ConversionError(
                    f"--keep-dense: expected a Hugging Face checkpoint folder as INPUT (the dense export to keep), "
                    f"found the ONNX model {ref.path}"
                )
        except NoOnnxFile as exc:  # a Hugging Face checkpoint (config.json, no ONNX file): export it first
            if not (exc.folder / "config.json").is_file():
                raise
            try:
                ref = ModelRef(Path(_export_first(args, exc.folder, _dense_folder(args, stack))), exc.folder)
            except OrtpaError as err:  # one line: the folder was no ONNX model, and exporting it failed too
                raise ConversionError(f"{exc}; exporting it as a Hugging Face checkpoint failed: {err}") from err
        progress = _convert_progress(args)
        verified: list = []
        try:
            proto, deployment = convert_deployment(
                ref,
                args.output,
                portable=args.portable,
                genai=genai,
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
                providers=args.providers,
                verify=not args.no_verify,
                on_verified=verified.append,
            )
        finally:
            if progress is not None:
                progress.close()
    portable = deployment.portable
    nodes = portable.nodes if portable else sum(1 for n in proto.graph.node if n.op_type == "PagedAttention")
    # genai_config.json is written for the paged model (a source's dense one is not copied as is)
    copied = [n for n, _ in companion_files(ref.folder) if n != "genai_config.json"] if ref.folder is not None else []
    result = {
        "input": str(ref.path),
        "output": args.output,
        "paged_attention_nodes": nodes,
        "portable": portable is not None,
        "split_latent": bool(portable and portable.split_latent),
        "genai_config": str(deployment.genai_config),
        "copied": copied,
        "verification": verified[0].summary() if verified else None,
    }
    written = json.loads(deployment.genai_config.read_text(encoding="utf-8"))
    if "eos_token_id" not in written["model"] and not args.quiet:
        # genai then ends every request at its default id 0: say so rather than let a deployment stop early
        print(
            "ortpa convert: note: no eos_token_id found (no genai_config.json, config.json or generation_config.json "
            "beside the input): genai_config.json has none, and onnxruntime-genai then stops at token id 0; add "
            '"eos_token_id" to its "model" section',
            file=sys.stderr,
        )
    if args.json:
        print(json.dumps(result))
    elif not args.quiet:
        also = f" (and copied {', '.join(copied)} beside it)" if copied else ""
        kind = "lowered to standard ONNX ops (--portable)" if portable else "PagedAttention node(s)"
        check = (
            f"; verified against the original (float32 twin: max |d| / scale "
            f"{verified[0].verdict.structure.max_relative_error:.1e}; {verified[0].verdict.precision.dtype}: KL max "
            f"{verified[0].verdict.precision.kl_max:.1e}, max |dlogit| {verified[0].max_abs_logit_error:.2e})"
            if verified
            else "; NOT verified (--no-verify)"
        )
        print(f"wrote {args.output}: {nodes} {kind}, genai_config.json{also}{check}")
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
        "a temporary folder first (needs the export extra; --keep-dense DIR keeps it)",
    )
    p.add_argument(
        "output",
        help="where to write the paged model (a regular file; a folder or repo input's tokenizer and config "
        "files are copied beside it)",
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
    p.add_argument("--json", action="store_true", help="print the result as JSON (with the verification's figures)")
    p.add_argument(
        "--portable",
        action="store_true",
        help="lower every PagedAttention node to standard ONNX ops (model-local functions) after validating it: "
        "plain ONNX Runtime runs the file on any execution provider, onnxruntime-genai's Engine on CPU; MLA "
        "(LATENT) caches are split into a key and a value half. Default: the native op (CUDA, WebGPU)",
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
