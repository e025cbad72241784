"""``ortpa demo``: the whole pipeline on a built-in DeepSeek-style MLA model."""

from __future__ import annotations

import argparse
import json
import sys

from ortpa.cli._common import COMMANDS, EXIT_INVALID, EXIT_OK, add_common

__all__ = ["register", "run"]


def run(args: argparse.Namespace) -> int:
    from ortpa.demo import run_demo

    progress = None if args.quiet or args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    summary = run_demo(args.out_dir, provider=args.provider, quiet=True, progress=progress)
    print(json.dumps(summary.to_dict(), indent=2) if args.json else summary.format())
    return EXIT_OK if summary.ok else EXIT_INVALID


def register(sub) -> None:
    p = sub.add_parser(
        "demo",
        help=COMMANDS["demo"],
        description="Build a small dense MLA model with random weights, convert it to PagedAttention LATENT, "
        "validate it, generate with continuous batching on the best provider, and check parity with the dense "
        "original. Exits 1 if parity fails.",
        epilog="examples:\n  ortpa demo\n  ortpa demo --out-dir ./demo --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out-dir", default=None, help="where to write the two models (default: a temp dir)")
    p.add_argument("--provider", choices=["cpu", "cuda"], default=None)
    p.add_argument("--json", action="store_true")
    add_common(p)
    p.set_defaults(func=run)
