"""``ortpa parity``: the converted model against its original, run alone in its own format."""

from __future__ import annotations

import argparse
import json
import sys

from ortpa.cli._common import (
    COMMANDS,
    EXIT_INVALID,
    EXIT_OK,
    EXIT_USAGE,
    MODEL_HELP,
    add_common,
    add_revision,
    prompt_ids,
)
from ortpa.errors import InvalidModel

__all__ = ["register", "run"]


def run(args: argparse.Namespace) -> int:
    from ortpa.formats.detect import length_thresholds
    from ortpa.model.file import read_model
    from ortpa.model.ref import is_repo_id, resolve_any
    from ortpa.parity.check import default_prompts
    from ortpa.parity.verify import Deployment, diverging_layer, prove, verification_blocks
    from ortpa.providers import providers_for

    if args.revision is not None and not (is_repo_id(args.original) or is_repo_id(args.converted)):
        print("ortpa parity: error: --revision needs a Hugging Face repo id as a model", file=sys.stderr)
        return EXIT_USAGE
    # --revision applies to whichever model is a repo id
    original, converted = (
        resolve_any(m, args.revision if is_repo_id(m) else None) for m in (args.original, args.converted)
    )
    _check_kinds(original, converted)
    if not args.prompt_ids:
        args.prompt_ids = default_prompts(length_thresholds(read_model(original, load_external_data=False).proto))
    # on CPU, the sessions and options of convert's own verification; --provider cuda runs the deployed model there
    on_cpu = args.provider in (None, "cpu")
    deployment = Deployment(args.num_blocks, args.block_size, None if on_cpu else tuple(providers_for(args.provider)))
    # the one rule of convert's verification (ortpa.parity.verify.prove), the same reference: a float32 original
    # run alone in its own format, a half original's float32 twin (never the half original itself); structure on
    # the float32 twin (CPU), precision of the deployed model, both teacher-forced on the reference's tokens. The
    # twins get the blocks the prompts need, as in convert; the deployed model the blocks asked for
    blocks = verification_blocks(args.prompt_ids, args.max_new_tokens)
    verdict, twins, want = prove(original, converted, args.prompt_ids, args.max_new_tokens, blocks, deployment)
    where = None
    if not verdict.structure.ok:
        where = diverging_layer(original, converted, twins, args.prompt_ids, want, verdict.structure)
    if args.json:
        print(json.dumps({**verdict.to_dict(), "first_diverging_layer": where}, indent=2))
    elif args.quiet:  # the verdict line only
        print(verdict.format().splitlines()[-1])
    else:
        print((f"first diverging layer: {where}\n" if where is not None else "") + verdict.format())
    return EXIT_OK if verdict.ok else EXIT_INVALID


def _check_kinds(original, converted) -> None:
    """The dense original first, its conversion second: either one of the other kind is said as such, before
    ONNX Runtime fails on it with its own words."""
    from ortpa.model.file import read_model
    from ortpa.model.kind import ModelKind, model_kind

    def kind(path):
        return model_kind(read_model(path, copy=False, check_runtime=False, load_external_data=False).proto)

    if kind(original) is not ModelKind.DENSE:
        raise InvalidModel(
            str(original),
            "ORIGINAL is already a paged model: parity runs the dense original (past/present KV) against its "
            "conversion, `ortpa parity DENSE CONVERTED`",
        )
    if kind(converted) is ModelKind.DENSE:
        raise InvalidModel(
            str(converted),
            "CONVERTED is a dense model (no PagedAttention, no block_table): convert it first, "
            "`ortpa convert DENSE paged.onnx`, then `ortpa parity DENSE paged.onnx`",
        )


def register(sub) -> None:
    p = sub.add_parser(
        "parity",
        help=COMMANDS["parity"],
        description="Greedy decoding of each prompt alone on the dense model (ONNX Runtime CPU, past/present KV, "
        "fed in its own format: dynamo export, onnxruntime-genai builder, optimum, transformers' OnnxExporter) and "
        "of all prompts batched on the converted model and on its float32 twin (a --portable file's: the file with "
        "its lowered functions run in float32; a --dtype float16 conversion's: compared with the original computing "
        "from its weights rounded to float16); judges structure (the twin within a float32 bound of the original) "
        "and precision (token agreement under the tie rule, top-k overlap, KL "
        "divergence within the deployed dtype's bound: ortpa.tolerances). "
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
    p.add_argument("--provider", choices=["cpu", "cuda"], default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=256)
    p.add_argument("--json", action="store_true")
    add_common(p)
    p.set_defaults(func=run)
