"""Find, run and print benchmarks: the built-in ``ortpa.bench.*`` modules plus an optional folder of ``*.py``."""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ortpa.errors import InvalidParameter, MissingExtra
from ortpa.extras import extra_providing, require_extra

__all__ = ["builtin_benchmarks", "format_table", "run_benchmarks"]

_COLUMNS = ("name", "metric", "value", "unit", "notes")
_NOT_BENCHMARKS = frozenset({"runner"})


def builtin_benchmarks() -> list[str]:
    """Names of the benchmark modules shipped in ``ortpa.bench``."""
    import ortpa.bench as package

    return sorted(
        m.name
        for m in pkgutil.iter_modules(package.__path__)
        if not m.name.startswith("_") and m.name not in _NOT_BENCHMARKS
    )


def _folder_modules(path: Path | None) -> dict[str, Path]:
    if path is None or not path.is_dir():
        return {}
    return {p.stem: p for p in sorted(path.glob("*.py")) if not p.name.startswith("_")}


def _load(name: str, folder: dict[str, Path]) -> ModuleType:
    if name not in folder:
        return importlib.import_module(f"ortpa.bench.{name}")
    module_name = f"ortpa_bench_{name}"
    spec = importlib.util.spec_from_file_location(module_name, folder[name])
    if spec is None or spec.loader is None:
        raise InvalidParameter(
            "ortpa bench", "--path", "a folder of importable *.py benchmark modules", str(folder[name])
        )
    module = importlib.util.module_from_spec(spec)
    # registered before it runs, as an import would: dataclasses and pickling look the module up by name
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(module_name, None)
        raise
    return module


def run_benchmarks(
    path: str | os.PathLike | None = "benchmarks",
    *,
    names: Sequence[str] | None = None,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the built-in benchmarks and those in the folder ``path`` (skipped where it does not exist; a module
    there of the same name as a built-in one replaces it); ``names`` selects some. Returns every row, each with
    its ``benchmark`` name."""
    folder = _folder_modules(Path(path) if path is not None else None)
    available = sorted({*builtin_benchmarks(), *folder})
    chosen = available
    if names:
        unknown = set(names) - set(available)
        if unknown:
            raise InvalidParameter("ortpa bench", "--only", f"benchmark names from {available}", sorted(unknown))
        chosen = [n for n in available if n in set(names)]
    rows: list[dict[str, Any]] = []
    for name in chosen:
        if progress:
            progress(f"running {name}")
        try:
            module = _load(name, folder)
            if not hasattr(module, "run"):
                continue
            for extra in getattr(module, "EXTRAS", ()):  # what the module declares it needs
                require_extra(extra, f"benchmark {name}")
            rows += [{"benchmark": name, **row} for row in module.run(quick=quick)]
        except MissingExtra as exc:
            rows.append(_not_available(name, str(exc)))
        except ModuleNotFoundError as exc:  # an optional package the module did not declare: still one row
            extra = extra_providing(exc.name)
            if extra is None:
                raise
            rows.append(_not_available(name, str(MissingExtra(f"benchmark {name}", extra, [exc.name or "?"]))))
    return rows


def _not_available(name: str, why: str) -> dict[str, Any]:
    return {"benchmark": name, "name": name, "metric": "not run", "notes": f"not available: {why}"}


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
