"""``ortpa bench``: the benchmark modules of :mod:`ortpa.bench` and a checkout's ``benchmarks/``."""

from __future__ import annotations

import argparse
import json

from ortpa.cli._common import COMMANDS, EXIT_OK, add_common, progress_printer

__all__ = ["register", "run"]


def run(args: argparse.Namespace) -> int:
    from ortpa.bench import format_table, run_benchmarks

    rows = run_benchmarks(args.path, names=args.only, quick=args.quick, progress=progress_printer(args))
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return EXIT_OK


def register(sub) -> None:
    p = sub.add_parser(
        "bench",
        help=COMMANDS["bench"],
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
    add_common(p)
    p.set_defaults(func=run)
