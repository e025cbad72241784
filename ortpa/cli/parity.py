"""``ortpa parity``: the converted model against its original, run alone in its own format."""

from __future__ import annotations

import argparse
import json
import sys

from ortpa.cli._common import EXIT_INVALID, EXIT_OK, EXIT_USAGE, MODEL_HELP, add_common, add_revision, prompt_ids
from ortpa.tolerances import FAMILY_EXTRA_ATOL, logit_tolerance

__all__ = ["register", "run"]


def run(args: argparse.Namespace) -> int:
    from ortpa.model.ref import is_repo_id, resolve_any
    from ortpa.parity.check import compare_runs, default_prompts
    from ortpa.parity.greedy import dense_greedy, open_dense, paged_greedy
    from ortpa.providers import providers_for
    from ortpa.runtime.session import PagedSession

    if args.revision is not None and not (is_repo_id(args.original) or is_repo_id(args.converted)):
        print("ortpa parity: error: --revision needs a Hugging Face repo id as a model", file=sys.stderr)
        return EXIT_USAGE
    # --revision applies to whichever model is a repo id
    original, converted = (
        resolve_any(m, args.revision if is_repo_id(m) else None) for m in (args.original, args.converted)
    )
    # the original runs alone, in its own format (genai, optimum, OnnxExporter, dynamo: ortpa.formats.detect)
    dense = open_dense(original)
    if not args.prompt_ids:
        args.prompt_ids = default_prompts(dense.thresholds)
    paged = PagedSession(
        converted,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        providers=providers_for(args.provider) if args.provider else None,
    )
    rtol, atol = logit_tolerance(_cache_dtype(paged), args.family, source_int4=_int4_source(original))
    if args.atol is not None:
        atol = args.atol
    ref = dense_greedy(dense.session, args.prompt_ids, args.max_new_tokens, interface=dense.interface)
    # teacher forcing: the converted model reads the original's tokens, so a tie flip does not cascade
    got = paged_greedy(paged, args.prompt_ids, args.max_new_tokens, follow=ref.tokens)
    result = compare_runs(ref, got, rtol=rtol, atol=atol)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.format())
    ok = result.ok
    return EXIT_OK if ok else EXIT_INVALID


def _int4_source(path) -> bool:
    """Whether the original's projections are int4 (``com.microsoft::MatMulNBits``, onnxruntime-genai int4)."""
    from ortpa.model.file import read_model

    graph = read_model(path, load_external_data=False).proto.graph
    return any(n.op_type == "MatMulNBits" for n in graph.node)


def _cache_dtype(paged) -> str:
    """The converted model's cache dtype name (``"float16"``, ``"bfloat16"``, ``"int8"``...), for the tolerance."""
    from ortpa.dtypes import dtype_name

    declared = {i.name: i for i in paged.session.model.graph.input}
    return dtype_name(declared[paged.aliases[0].input_name].type.tensor_type.elem_type)


def register(sub) -> None:
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
    p.add_argument("original", help="the dense model (past/present KV caches)" + MODEL_HELP)
    p.add_argument("converted", help="the converted paged model" + MODEL_HELP)
    add_revision(p)
    p.add_argument("--prompt-ids", type=prompt_ids, action="append", default=None)
    p.add_argument("--max-new-tokens", type=int, default=8)
    p.add_argument(
        "--atol",
        type=float,
        default=None,
        help="absolute logit tolerance (default: ortpa.tolerances for the cache dtype, e.g. 5e-3 for float16, "
        "0.155 for int8 caches, plus ortpa.tolerances.SOURCE_INT4_EXTRA_ATOL for an int4 original; plus rtol * "
        "|dense logit|)",
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
    add_common(p)
    p.set_defaults(func=run)
