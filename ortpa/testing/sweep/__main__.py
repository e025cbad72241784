"""``python -m ortpa.testing.sweep [--family F ...] [--seeds N] [--out docs/sweep.md]``: the whole sweep."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from ortpa.testing.sweep.report import markdown
from ortpa.testing.sweep.run import Outcome, run_draw
from ortpa.testing.sweep.space import FAMILIES, draw


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ortpa.testing.sweep", description=__doc__.splitlines()[0])
    ap.add_argument("--family", nargs="*", choices=sorted(FAMILIES), help="families to sweep (default: all)")
    ap.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per family (default 3)")
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--out", default="docs/sweep.md", help="the markdown report (default docs/sweep.md)")
    ap.add_argument("--jsonl", default=None, help="also append each outcome as a JSON line here, as it comes")
    ap.add_argument(
        "--from-jsonl",
        nargs="+",
        default=None,
        help="write the report from --jsonl files of earlier runs (a later line replaces an earlier one of the same "
        "family and seed)",
    )
    args = ap.parse_args(argv)
    families = args.family or list(FAMILIES)
    outcomes: list[Outcome] = []
    if args.from_jsonl:  # a sweep cut short still has its outcomes, one line each
        latest: dict[tuple[str, int], Outcome] = {}
        for path in args.from_jsonl:
            for line in Path(path).read_text(encoding="utf-8").splitlines():
                if line.strip():
                    outcome = Outcome(**json.loads(line))
                    latest[outcome.family, outcome.seed] = outcome
        outcomes = list(latest.values())
        args.seeds = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for family in families:  # seed-major: a cut-short sweep still covers every family
            outcome = run_draw(draw(family, seed))
            outcomes.append(outcome)
            print(
                f"{outcome.outcome:26s} {family:12s} seed {seed}  {outcome.seconds:6.1f} s  {outcome.config}"
                + (f"\n    {outcome.reason}" if outcome.reason else ""),
                flush=True,
            )
            if args.jsonl:
                with open(args.jsonl, "a", encoding="utf-8") as f:
                    f.write(json.dumps(outcome.to_dict()) + "\n")
    Path(args.out).write_text(markdown(outcomes, when=time.strftime("%Y-%m-%d")), encoding="utf-8")
    bad = [o for o in outcomes if o.outcome not in ("converted-and-correct", "refused-with-a-named-leak")]
    print(f"{len(outcomes)} configs, {len(bad)} not correct; wrote {args.out}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
