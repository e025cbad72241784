"""``ortpa generate``: greedy generation with continuous batching on a converted model."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ortpa.cli._common import (
    COMMANDS,
    EXIT_OK,
    MODEL_HELP,
    add_common,
    add_pipeline_options,
    add_revision,
    prompt_ids,
)
from ortpa.errors import InvalidModel, InvalidRequest

__all__ = ["register", "run"]


def run(args: argparse.Namespace) -> int:
    from ortpa.model.ref import ModelRef, locate_model
    from ortpa.providers import providers_for
    from ortpa.runtime.engine import Engine
    from ortpa.runtime.sampling import SamplingParams
    from ortpa.runtime.stage_folder import is_stage_folder

    if is_stage_folder(args.model):  # a stage folder (`ortpa split`): its tokenizer files are in it
        ref = ModelRef(Path(args.model) / "stages.json", Path(args.model))
    else:
        ref = locate_model(args.model, args.revision)
    if not ref.path.exists():  # said before anything looks for a tokenizer beside it
        raise InvalidModel(os.fspath(args.model), "no such file or folder")
    tokenizer = None
    prompts = args.prompt_ids
    stop: list[int] = []
    if args.prompt is not None:
        from ortpa.model.folder import eos_token_ids, load_tokenizer

        where = args.tokenizer if args.tokenizer is not None else ref.folder  # None: next to the model file
        tokenizer = load_tokenizer(ref.path, where)
        prompts = [tokenizer.encode(text).ids for text in args.prompt]
        if any(not ids for ids in prompts):
            raise InvalidRequest(f"--prompt: expected text the tokenizer encodes to tokens, got {args.prompt!r}")
        stop = eos_token_ids(ref.path, where)
    engine = Engine(
        ref.folder if ref.path.name == "stages.json" else ref.path,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        providers=providers_for(args.provider) if args.provider else None,
        ray_address=args.ray_address,
        placement=args.placement,
        micro_batches=args.micro_batches,
    )
    try:
        outputs = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=stop))
    finally:
        engine.close()
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


def register(sub) -> None:
    p = sub.add_parser(
        "generate",
        help=COMMANDS["generate"],
        description="All prompts are batched continuously on the paged model (CUDA natively where present, "
        "else the portable CPU path). --prompt encodes text with the tokenizer.json next to the model (or in "
        "--tokenizer) and prints text; generation stops at the EOS ids of generation_config.json found there.",
        epilog="examples:\n  ortpa generate paged.onnx --prompt-ids 1,2,3 --prompt-ids 7,8 --max-new-tokens 16\n"
        "  ortpa generate paged.onnx --prompt-ids 5,6 --max-new-tokens 4 --json\n"
        '  ortpa generate paged.onnx --prompt "The capital of France is" --max-new-tokens 16',
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", help="a converted (paged) ONNX model, or a stage folder (`ortpa split`)" + MODEL_HELP)
    add_revision(p)
    given = p.add_mutually_exclusive_group(required=True)
    given.add_argument(
        "--prompt-ids",
        type=prompt_ids,
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
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="tokens one step computes (a longer prompt is prefilled in chunks; default: the Engine's, 1024)",
    )
    add_pipeline_options(p)
    p.add_argument(
        "--json",
        action="store_true",
        help='print {"outputs": [[ids...], ...]} in prompt order (with --prompt, also "texts")',
    )
    add_common(p)
    p.set_defaults(func=run)
