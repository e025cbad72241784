"""Collect and print the benchmarks in ``benchmarks/``: each module's ``run(quick) -> list[dict]``."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ortpa.errors import InvalidModel

__all__ = ["format_table", "run_benchmarks"]

_COLUMNS = ("name", "metric", "value", "unit", "notes")


def _modules(path: Path, names: Sequence[str] | None) -> list[Path]:
    if not path.is_dir():
        raise InvalidModel(str(path), "no benchmarks folder here; run from the repository root or pass --path")
    found = sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
    if names:
        wanted = set(names)
        unknown = wanted - {p.stem for p in found}
        if unknown:
            raise InvalidModel(str(path), f"unknown benchmark(s) {sorted(unknown)}; have {[p.stem for p in found]}")
        found = [p for p in found if p.stem in wanted]
    return found


def run_benchmarks(
    path: str | os.PathLike = "benchmarks",
    *,
    names: Sequence[str] | None = None,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for file in _modules(Path(path), names):
        if progress:
            progress(f"running {file.stem}")
        spec = importlib.util.spec_from_file_location(f"ortpa_bench_{file.stem}", file)
        module = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(module)
        if not hasattr(module, "run"):
            continue
        for row in module.run(quick=quick):
            rows.append({"benchmark": file.stem, **row})
    return rows


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    cols = (("benchmark",) if any("benchmark" in r for r in rows) else ()) + _COLUMNS
    cells = [[_fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = "  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(out)
