"""``python -m ortpa.testing.sweep [--tool T] [--family F ...] [--seeds N] [--out docs/sweep.md]``: the whole sweep."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ortpa.testing.sweep.report import markdown, tool_tables
from ortpa.testing.sweep.run import CORRECT, LEAK, UNSUPPORTED, Outcome, run_draw
from ortpa.testing.sweep.space import FAMILIES, TOOL_FAMILIES, TOOLS, draw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortpa.testing.sweep", description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tool",
        default="dynamo",
        choices=TOOLS,
        help="the exporter of each drawn checkpoint (default dynamo: `ortpa convert HF_DIR`); genai and optimum run "
        "in their own venvs (ortpa/testing/export_tools.py)",
    )
    ap.add_argument(
        "--family", nargs="*", choices=sorted(FAMILIES), help="families to sweep (default: every one the tool exports)"
    )
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per family (default 3)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--out", default="docs/sweep.md", help="the markdown report (default docs/sweep.md)")
    ap.add_argument("--jsonl", default=None, help="also append each outcome as a JSON line here, as it comes")
    ap.add_argument(
        "--from-jsonl",
        nargs="+",
        default=None,
        help="write the report from --jsonl files of earlier runs (a later line replaces an earlier one of the same "
        "tool, family and seed)",
    )
    args = ap.parse_args(argv)
    families = args.family or list(TOOL_FAMILIES[args.tool])
    unsupported = sorted(set(families) - set(TOOL_FAMILIES[args.tool]))
    if unsupported:
        ap.error(f"--tool {args.tool} does not export {unsupported}; it exports {list(TOOL_FAMILIES[args.tool])}")
    outcomes: list[Outcome] = []
    if args.from_jsonl:  # a sweep cut short still has its outcomes, one line each
        latest: dict[tuple[str, str, int], Outcome] = {}
        for path in args.from_jsonl:
            for line in Path(path).read_text(encoding="utf-8").splitlines():
                if line.strip():
                    outcome = Outcome(**json.loads(line))
                    latest[outcome.tool, outcome.family, outcome.seed] = outcome
        outcomes = list(latest.values())
        args.seeds = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for family in families:  # seed-major: a cut-short sweep still covers every family
            outcome = run_draw(draw(family, seed, args.tool))
            outcomes.append(outcome)
            print(
                f"{outcome.outcome:26s} {args.tool:13s} {family:12s} seed {seed}  {outcome.seconds:6.1f} s  "
                f"{outcome.config}" + (f"\n    {outcome.reason}" if outcome.reason else ""),
                flush=True,
            )
            if args.jsonl:
                with open(args.jsonl, "a", encoding="utf-8") as f:
                    f.write(json.dumps(outcome.to_dict()) + "\n")
    dynamo = [o for o in outcomes if o.tool == "dynamo"]
    # dynamo draws: the whole page; other tools': their tables alone, which docs/sweep.md keeps in its own section
    page = markdown(dynamo, when=time.strftime("%Y-%m-%d")) if len(dynamo) == len(outcomes) else tool_tables(outcomes)
    Path(args.out).write_text(page, encoding="utf-8")
    bad = [o for o in outcomes if o.outcome not in (CORRECT, LEAK, UNSUPPORTED)]
    print(f"{len(outcomes)} configs, {len(bad)} not correct; wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
