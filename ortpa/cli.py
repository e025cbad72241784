"""The ``ortpa`` console script.

Exit codes: 0 success, 1 the model or input is invalid (diagnostics printed), 2 usage errors.
Errors print without a traceback unless ``--verbose`` is given.

Over ~400 lines on purpose: it is the argparse table of seven commands with their help texts and the thin
``_cmd_*`` functions that call the API; each command's work lives in the package (``rewriter``, ``runtime``,
``formats``, ``export``), so a split would only separate a parser from the ten lines that use it.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ortpa.errors import ConversionError, InvalidRequest, OrtpaError
from ortpa.tolerances import FAMILY_EXTRA_ATOL, logit_tolerance

__all__ = ["main"]

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2

_EPILOG = """examples:
  ortpa demo
  ortpa convert dense.onnx paged.onnx
  ortpa convert ./DeepSeek-V2-Lite paged.onnx      (a Hugging Face folder: export, then convert)
  ortpa validate paged.onnx --backend cuda
  ortpa generate paged.onnx --prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 8 --json
  ortpa generate paged.onnx --prompt "Hello" --max-new-tokens 32
  ortpa parity dense.onnx paged.onnx --prompt-ids 1,2,3
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 on usage errors; keep that, shorter text
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


_MODEL_HELP = "; or a model folder, or a Hugging Face repo id ORG/NAME in the local cache (never downloaded)"


def _add_revision(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--revision",
        default=None,
        help="branch, tag or commit of a Hugging Face repo id given as a model (default: main); offline",
    )


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true", help="show tracebacks and debug detail")
    p.add_argument("--quiet", action="store_true", help="print only errors and the final result")


# --------------------------------------------------------------------------------------------- validate
def _cmd_validate(args: argparse.Namespace) -> int:
    from ortpa.ops.validate import validate_model

    report = validate_model(args.model, backend=args.backend, revision=args.revision)
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
    p.add_argument("model", help="path to an .onnx file" + _MODEL_HELP)
    _add_revision(p)
    p.add_argument(
        "--backend",
        choices=["cuda", "webgpu", "portable"],
        default=None,
        help="also check that this backend implements every feature the nodes use",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    _add_common(p)
    p.set_defaults(func=_cmd_validate)


# ---------------------------------------------------------------------------------------------- convert
def _progress_printer(args: argparse.Namespace) -> Callable[[str], None] | None:
    if args.quiet:
        return None
    return lambda message: print(f"  {message}", file=sys.stderr, flush=True)


def _convert_progress(args: argparse.Namespace):
    """A bar on a terminal, plain lines otherwise, nothing with --quiet (ortpa.cli_progress)."""
    if args.quiet:
        return None
    from ortpa.cli_progress import ConvertProgress

    return ConvertProgress(sys.stderr)


def _export_first(args: argparse.Namespace, folder: Path) -> str:
    """``convert HF_DIR OUT``: export the checkpoint ``folder`` to ``OUT.dense.onnx`` first; that file's path."""
    try:
        from ortpa.export import export_hf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ConversionError(
            f"{args.input} is a Hugging Face checkpoint: exporting it needs the export extra "
            f"(pip install 'ortpa[export]'): {exc}"
        ) from None
    progress = _progress_printer(args)
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


def _cmd_convert(args: argparse.Namespace) -> int:
    from ortpa.model_ref import ModelRef, NoOnnxFile, companion_files, locate_model
    from ortpa.rewriter.pipeline import convert_file

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
        )
    finally:
        if progress is not None:
            progress.close()
    nodes = sum(1 for n in proto.graph.node if n.op_type == "PagedAttention")
    copied = [name for name, _ in companion_files(ref.folder)] if ref.folder is not None else []
    result = {"input": str(ref.path), "output": args.output, "paged_attention_nodes": nodes, "copied": copied}
    if args.json:
        print(json.dumps(result))
    elif not args.quiet:
        also = f" (and copied {', '.join(copied)} beside it)" if copied else ""
        print(f"wrote {args.output}: {nodes} PagedAttention node(s){also}")
    return EXIT_OK


def _register_convert(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="convert a dense-attention ONNX model to a paged PagedAttention model",
        description="Rewrite dense MLA attention (DeepSeek-style) into PagedAttention LATENT and MHA/GQA into "
        "SEPARATE, replace past/present KV by paged caches and index inputs, validate, and write atomically. "
        "The input is never modified; a model or layer that does not match is reported and nothing is written.",
        epilog="examples:\n  ortpa convert dense.onnx paged.onnx\n"
        "  ortpa convert dense.onnx paged.onnx --dtype float16 --rope-in-op\n"
        "  ortpa convert ORG/NAME out/model.onnx --revision main   # a repo in the local Hugging Face cache",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "input",
        help="dense ONNX model (e.g. from `ortpa export` or torch.onnx.export)"
        + _MODEL_HELP
        + "; a Hugging Face checkpoint folder (config.json and weights, no .onnx file) is exported to "
        "OUTPUT.dense.onnx first (needs the export extra)",
    )
    p.add_argument(
        "output",
        help="where to write the paged model (a regular file; a folder or repo input's tokenizer and config "
        "files are copied beside it)",
    )
    _add_revision(p)
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
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    _add_export_options(p.add_argument_group("when INPUT is a Hugging Face folder"), dtype_dest="export_dtype")
    _add_common(p)
    p.set_defaults(func=_cmd_convert)


# ----------------------------------------------------------------------------------------------- export
def _cmd_export(args: argparse.Namespace) -> int:
    try:
        from ortpa.export import export_hf
    except ImportError as exc:  # pragma: no cover - depends on the environment
        print(f"ortpa export needs the export extra (pip install 'ortpa[export]'): {exc}", file=sys.stderr)
        return EXIT_INVALID
    dense = args.output if args.dense_only else args.output + ".dense.onnx"
    progress = _progress_printer(args)
    info = export_hf(
        args.model,
        dense,
        random_weights=args.random_weights,
        opset=args.opset,
        attn_implementation=args.attn_implementation,
        experts=args.experts,
        dtype=args.dtype,
        external_data=True if args.external_data else None,
        progress=progress,
        verbose=args.verbose,
    )
    if not args.dense_only:
        from ortpa.rewriter.pipeline import convert_file

        convert_file(dense, args.output, dtype=args.convert_dtype, progress=progress)
    if args.json:
        print(json.dumps({"dense": dense, "output": args.output, "info": dict(info)}, default=str))
    elif not args.quiet:
        print(f"wrote {dense}" + ("" if args.dense_only else f" and {args.output}"))
    return EXIT_OK


def _add_export_options(p, dtype_dest: str = "dtype") -> None:
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
        help="dtype of the export (default: the checkpoint's as stored; float32 for --random-weights)",
    )
    p.add_argument(
        "--external-data", action="store_true", help="weights in OUTPUT.data (default: only past 1 GB of weights)"
    )


def _register_export(sub) -> None:
    p = sub.add_parser(
        "export",
        help="export a Hugging Face model (local dir or config) to dense ONNX, then convert it",
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
    _add_export_options(p)
    p.add_argument(
        "--dtype",
        dest="convert_dtype",
        choices=["float16", "bfloat16"],
        default=None,
        help="convert the paged model to this dtype (as `ortpa convert --dtype`)",
    )
    p.add_argument("--dense-only", action="store_true", help="write only the dense export to OUTPUT")
    p.add_argument("--json", action="store_true")
    _add_common(p)
    p.set_defaults(func=_cmd_export)


# ------------------------------------------------------------------------------------------------ bench
def _cmd_bench(args: argparse.Namespace) -> int:
    from ortpa.bench import format_table, run_benchmarks

    rows = run_benchmarks(args.path, names=args.only, quick=args.quick, progress=_progress_printer(args))
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return EXIT_OK


def _register_bench(sub) -> None:
    p = sub.add_parser(
        "bench",
        help="run the built-in benchmarks (ortpa.bench) and those in ./benchmarks; print one table",
        description="Each benchmark module (ortpa.bench.*, plus *.py in --path) exposes run(quick) -> rows; "
        "ratios are measured against a baseline in the same run.",
        epilog="examples:\n  ortpa bench --quick\n  ortpa bench --only oracle portable --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--path", default="benchmarks", help="extra benchmarks folder, used where it exists (default: ./benchmarks)"
    )
    p.add_argument("--only", nargs="*", default=None, help="module names to run (default: all)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--json", action="store_true")
    _add_common(p)
    p.set_defaults(func=_cmd_bench)


# ---------------------------------------------------------------------------------------------- generate
def _prompt_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip() != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"expected at least one non-negative token id, got {text!r}")
    return ids


def _cmd_generate(args: argparse.Namespace) -> int:
    from ortpa.model_ref import resolve_any
    from ortpa.runtime.device import providers_for
    from ortpa.runtime.engine import Engine
    from ortpa.runtime.sampling import SamplingParams

    tokenizer = None
    prompts = args.prompt_ids
    stop: list[int] = []
    if args.prompt is not None:
        from ortpa.hf_folder import eos_token_ids, load_tokenizer
        from ortpa.model_ref import locate_model

        ref = locate_model(args.model, args.revision)
        where = args.tokenizer if args.tokenizer is not None else ref.folder  # None: next to the model file
        tokenizer = load_tokenizer(ref.path, where)
        prompts = [tokenizer.encode(text).ids for text in args.prompt]
        if any(not ids for ids in prompts):
            raise InvalidRequest(f"--prompt: expected text the tokenizer encodes to tokens, got {args.prompt!r}")
        stop = eos_token_ids(ref.path, where)
    engine = Engine(
        resolve_any(args.model, args.revision),
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        providers=providers_for(args.provider) if args.provider else None,
    )
    outputs = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=stop))
    if tokenizer is not None:
        texts = [tokenizer.decode([t for t in out if t not in stop]) for out in outputs]
        if args.json:
            print(json.dumps({"outputs": outputs, "texts": texts}))
        else:
            for text in texts:
                print(text)
    elif args.json:
        print(json.dumps({"outputs": outputs}))
    else:
        for prompt, out in zip(prompts, outputs, strict=True):
            print(",".join(map(str, prompt)), "->", ",".join(map(str, out)))
    return EXIT_OK


def _register_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="greedy generation with continuous batching on a converted model",
        description="All prompts are batched continuously on the paged model (CUDA natively where present, "
        "else the portable CPU path). --prompt encodes text with the tokenizer.json next to the model (or in "
        "--tokenizer) and prints text; generation stops at the EOS ids of generation_config.json found there.",
        epilog="examples:\n  ortpa generate paged.onnx --prompt-ids 1,2,3 --prompt-ids 7,8 --max-new-tokens 16\n"
        "  ortpa generate paged.onnx --prompt-ids 5,6 --max-new-tokens 4 --json\n"
        '  ortpa generate paged.onnx --prompt "The capital of France is" --max-new-tokens 16',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="a converted (paged) ONNX model" + _MODEL_HELP)
    _add_revision(p)
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument(
        "--prompt-ids",
        type=_prompt_ids,
        action="append",
        help="comma-separated token ids of one prompt; repeat for more prompts",
    )
    given.add_argument("--prompt", action="append", help="text of one prompt (needs a tokenizer.json); repeatable")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="folder holding tokenizer.json and generation_config.json (default: the model's folder)",
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--provider", choices=["cpu", "cuda"], default=None, help="default: CUDA if present, else CPU")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size (default: from a memory budget)")
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"outputs": [[ids...], ...]} in prompt order (with --prompt, also "texts")',
    )
    _add_common(p)
    p.set_defaults(func=_cmd_generate)


# ------------------------------------------------------------------------------------------------- demo
def _cmd_demo(args: argparse.Namespace) -> int:
    from ortpa.demo import run_demo

    progress = None if args.quiet or args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    summary = run_demo(args.out_dir, provider=args.provider, quiet=True, progress=progress)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary.format())
    return EXIT_OK if summary.ok else EXIT_INVALID


def _register_demo(sub) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole pipeline on a built-in DeepSeek-style MLA model (no downloads, no torch)",
        description="Build a small dense MLA model with random weights, convert it to PagedAttention LATENT, "
        "validate it, generate with continuous batching on the best provider, and check parity with the dense "
        "original. Exits 1 if parity fails.",
        epilog="examples:\n  ortpa demo\n  ortpa demo --out-dir ./demo --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out-dir", default=None, help="where to write the two models (default: a temp dir)")
    p.add_argument("--provider", choices=["cpu", "cuda"], default=None)
    p.add_argument("--json", action="store_true")
    _add_common(p)
    p.set_defaults(func=_cmd_demo)


# ----------------------------------------------------------------------------------------------- parity
def _cmd_parity(args: argparse.Namespace) -> int:
    from ortpa.model_ref import is_repo_id, resolve_any
    from ortpa.runtime.device import providers_for
    from ortpa.runtime.session import PagedSession
    from ortpa.testing.greedy import dense_greedy, open_dense, paged_greedy

    if args.revision is not None and not (is_repo_id(args.original) or is_repo_id(args.converted)):
        print("ortpa parity: error: --revision needs a Hugging Face repo id as a model", file=sys.stderr)
        return EXIT_USAGE
    # --revision applies to whichever model is a repo id
    original, converted = (
        resolve_any(m, args.revision if is_repo_id(m) else None) for m in (args.original, args.converted)
    )
    # the original runs alone, in its own format (genai, optimum, OnnxExporter, dynamo: ortpa.formats)
    dense = open_dense(original)
    if not args.prompt_ids:
        args.prompt_ids = _default_prompts(dense.thresholds)
    paged = PagedSession(
        converted,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        providers=providers_for(args.provider) if args.provider else None,
    )
    rtol, atol = logit_tolerance(_cache_dtype(paged), args.family)
    if args.atol is not None:
        atol = args.atol
    ref = dense_greedy(dense.session, args.prompt_ids, args.max_new_tokens, interface=dense.interface)
    got = paged_greedy(paged, args.prompt_ids, args.max_new_tokens)
    steps, within = [], True
    for step in range(args.max_new_tokens):
        pairs = [(g[step], r[step]) for g, r in zip(got.logits, ref.logits, strict=True) if step < min(len(g), len(r))]
        errs = [float(np.abs(g - r).max()) for g, r in pairs]
        within = within and all(bool((np.abs(g - r) <= atol + rtol * np.abs(r)).all()) for g, r in pairs)
        agree = sum(
            step < len(g) and step < len(r) and g[step] == r[step] for g, r in zip(got.tokens, ref.tokens, strict=True)
        )
        steps.append({"step": step, "max_abs_logit_error": max(errs) if errs else 0.0, "tokens_agree": agree})
    total_agree = all(g == r for g, r in zip(got.tokens, ref.tokens, strict=True))
    worst = max(s["max_abs_logit_error"] for s in steps)
    ok = total_agree and within
    result = {
        "ok": ok,
        "max_abs_logit_error": worst,
        "tokens_identical": total_agree,
        "steps": steps,
        "prompts": len(args.prompt_ids),
        "atol": atol,
        "rtol": rtol,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for s in steps:
            print(
                f"step {s['step']:3d}  max |dlogit| {s['max_abs_logit_error']:.3e}  "
                f"tokens agree {s['tokens_agree']}/{len(args.prompt_ids)}"
            )
        print(
            ("PARITY OK" if ok else "PARITY FAILED")
            + f": max |dlogit| {worst:.3e} (atol {atol:g} + rtol {rtol:g} * |dense|), "
            f"greedy tokens {'identical' if total_agree else 'differ'}"
        )
    return EXIT_OK if ok else EXIT_INVALID


def _cache_dtype(paged) -> str:
    """The converted model's cache dtype name (``"float16"``, ``"bfloat16"``, ``"int8"``...), for the tolerance."""
    from ortpa.dtypes import dtype_name

    declared = {i.name: i for i in paged.session.model.graph.input}
    return dtype_name(declared[paged.aliases[0].input_name].type.tensor_type.elem_type)


def _default_prompts(thresholds: Sequence[int]) -> list[list[int]]:
    """Three short prompts, and one longer than every length threshold of the original (LongRoPE's original
    length, a sliding window), so that parity also covers the branch a short prompt never reaches."""
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    if thresholds:
        prompts.append([11 + i % 64 for i in range(max(thresholds) + 8)])
    return prompts


def _register_parity(sub) -> None:
    p = sub.add_parser(
        "parity",
        help="run the same prompts through the dense original and the converted model; compare",
        description="Greedy decoding of each prompt alone on the dense model (ONNX Runtime CPU, past/present KV, "
        "fed in its own format: dynamo export, onnxruntime-genai builder, optimum, transformers' OnnxExporter) and "
        "of all prompts batched on the converted model; prints per-step max logit error and token agreement. "
        "Default prompts: three short ones and one longer than every length threshold of the original "
        "(LongRoPE's original length, a GroupQueryAttention window).",
        epilog="example:\n  ortpa parity dense.onnx paged.onnx --prompt-ids 1,2,3 --prompt-ids 4,5 --max-new-tokens 8",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("original", help="the dense model (past/present KV caches)" + _MODEL_HELP)
    p.add_argument("converted", help="the converted paged model" + _MODEL_HELP)
    _add_revision(p)
    p.add_argument("--prompt-ids", type=_prompt_ids, action="append", default=None)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument(
        "--atol",
        type=float,
        default=None,
        help="absolute logit tolerance (default: ortpa.tolerances for the cache dtype, e.g. 5e-3 for float16, "
        "0.155 for int8 caches; plus rtol * |dense logit|)",
    )
    p.add_argument(
        "--family",
        choices=sorted(FAMILY_EXTRA_ATOL),
        default=None,
        help="a model family measured with larger logit error (adds its ortpa.tolerances.FAMILY_EXTRA_ATOL)",
    )
    p.add_argument("--provider", choices=["cpu", "cuda"], default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--json", action="store_true")
    _add_common(p)
    p.set_defaults(func=_cmd_parity)


_REGISTRARS: list[Callable] = [
    _register_demo,
    _register_convert,
    _register_validate,
    _register_generate,
    _register_parity,
    _register_export,
    _register_bench,
]


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
    except OrtpaError as exc:  # ConversionError lists every failing layer with its reason
        if getattr(args, "verbose", False):
            traceback.print_exc()
        print(f"ortpa {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_INVALID
    except FileNotFoundError as exc:
        print(f"ortpa {args.command}: error: {exc.strerror}: {exc.filename}", file=sys.stderr)
        return EXIT_INVALID
    except Exception as exc:
        # ONNX Runtime's own exception types (Fail, InvalidGraph, ...) when it refuses a model that passed ortpa's
        # load checks (e.g. a corrupted constant): invalid input, said on one line; anything else is a bug
        if not type(exc).__module__.startswith("onnxruntime"):
            raise
        from ortpa.model_file import ort_message_line

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
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
