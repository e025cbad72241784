"""``ortpa bench``: benchmark modules, each exposing ``run(quick) -> list[dict]`` rows.

Development tooling, kept out of the runtime's import path: nothing in ``ortpa`` imports this subpackage except
the ``bench`` command. The built-in benchmarks live here, so ``ortpa bench`` works from an installed package;
a checkout's ``benchmarks/`` folder (``--path``, default ``./benchmarks`` where it exists) adds its own modules.
"""

from __future__ import annotations

from ortpa.bench.runner import builtin_benchmarks, format_table, run_benchmarks

__all__ = ["builtin_benchmarks", "format_table", "run_benchmarks"]
