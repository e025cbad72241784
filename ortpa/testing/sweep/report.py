"""The sweep's outcomes as markdown: counts per family, then one row per config."""

from __future__ import annotations

from collections.abc import Sequence

from ortpa.testing.sweep.run import OUTCOMES, UNSUPPORTED, Outcome
from ortpa.testing.sweep.space import FAMILIES

__all__ = ["command", "markdown", "tool_tables"]

_HEADER = """# The config sweep

Generated on {when} by

    python -m ortpa.testing.sweep {args}

(`--family F ...` sweeps some families, `--seeds N` draws seeds 0..N-1 of each; CI runs a few seeds in
`tests/testing/test_sweep.py`). Each row is one config drawn from a seed
(`ortpa/testing/sweep/space.py`), built with random weights, saved as a checkpoint in the dtype shown, exported
as `ortpa convert HF_DIR` exports it, converted with the default options (verification on), and its greedy
tokens, batched and alone, compared with the export's under the tie rule (`ortpa/testing/sweep/judge.py`).
Outcomes: `converted-and-correct`; `refused-with-a-named-leak` (the per-sequence flow shows a value that mixes
sequences); `refused-unsupported` (refused up front, naming a computation PagedAttention cannot express, such
as ALiBi); `refused-other` (any other refusal: a bug); `wrong` (written, tokens differ: a bug); `error` (the
sweep could not reach a verdict: a bug).
"""


def _columns(outcomes: Sequence[Outcome]) -> tuple[str, ...]:
    """The outcomes the counts show: every one, ``refused-unsupported`` only where a draw has it."""
    return tuple(k for k in OUTCOMES if k != UNSUPPORTED or any(o.outcome == k for o in outcomes))


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def command(outcomes: Sequence[Outcome]) -> str:
    """The arguments that draw exactly these configs (seeds 0..N-1 of each family swept)."""
    seeds = max((o.seed for o in outcomes), default=-1) + 1
    families = sorted({o.family for o in outcomes})
    chosen = "" if set(families) == set(FAMILIES) else f" --family {' '.join(families)}"
    short = len(families) * seeds - len({(o.family, o.seed) for o in outcomes})
    return f"--seeds {seeds}{chosen}" + (f"  # cut short: {short} of its configs not run" if short else "")


def markdown(outcomes: Sequence[Outcome], *, when: str = "") -> str:
    """The report: a header, counts per family and outcome, and every config with its outcome and reason."""
    lines = [_HEADER.format(args=command(outcomes), when=when), "## Counts per family", ""]
    columns = _columns(outcomes)
    lines.append("| family | " + " | ".join(columns) + " |")
    lines.append("|---|" + "---:|" * len(columns))
    families = sorted({o.family for o in outcomes})
    for family in [*families, "all"]:
        mine = [o for o in outcomes if family in ("all", o.family)]
        counts = " | ".join(str(sum(o.outcome == k for o in mine)) for k in columns)
        lines.append(f"| {'**all**' if family == 'all' else family} | {counts} |")
    lines += ["", "## Every config", ""]
    lines.append("| family | seed | config | outcome | max \\|dlogit\\| | seconds | reason |")
    lines.append("|---|---:|---|---|---:|---:|---|")
    for o in sorted(outcomes, key=lambda o: (o.family, o.seed)):
        err = "" if o.max_abs_logit_error is None else f"{o.max_abs_logit_error:.2e}"
        reason = o.reason or ""
        lines.append(
            f"| {o.family} | {o.seed} | {_cell(o.config)} | {o.outcome} | {err} | {o.seconds:.0f} | {_cell(reason)} |"
        )
    return "\n".join(lines) + "\n"


def tool_tables(outcomes: Sequence[Outcome]) -> str:
    """Counts per tool and family, then every config with its tool (the tool axis' section of docs/sweep.md)."""
    lines = ["### Counts per tool and family", ""]
    columns = _columns(outcomes)
    lines.append("| tool | family | " + " | ".join(columns) + " |")
    lines.append("|---|---|" + "---:|" * len(columns))
    keys = sorted({(o.tool, o.family) for o in outcomes})
    for tool in sorted({t for t, _ in keys}):
        for family in [*(f for t, f in keys if t == tool), "all"]:
            mine = [o for o in outcomes if o.tool == tool and family in ("all", o.family)]
            counts = " | ".join(str(sum(o.outcome == k for o in mine)) for k in columns)
            lines.append(f"| {tool} | {'**all**' if family == 'all' else family} | {counts} |")
    lines += ["", "### Every config", ""]
    lines.append("| tool | family | seed | config | outcome | max \\|dlogit\\| | seconds | reason |")
    lines.append("|---|---|---:|---|---|---:|---:|---|")
    for o in sorted(outcomes, key=lambda o: (o.tool, o.family, o.seed)):
        err = "" if o.max_abs_logit_error is None else f"{o.max_abs_logit_error:.2e}"
        lines.append(
            f"| {o.tool} | {o.family} | {o.seed} | {_cell(o.config)} | {o.outcome} | {err} | {o.seconds:.0f} "
            f"| {_cell(o.reason or '')} |"
        )
    return "\n".join(lines) + "\n"
