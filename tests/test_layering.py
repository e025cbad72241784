"""The package's import picture: no import cycle between ortpa's modules, and no layer importing one above it.

Imports are read from the source (``ast``), function-level ones included: a lazy import still ties two modules
together. Imports under ``if TYPE_CHECKING:`` never run, so they do not count for the layers' direction, but they
do count for cycles: two modules that need each other's types are one idea split in two (put the type in a leaf
both import). The layers, top to bottom, are the ones docs/architecture.md draws.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ortpa"

# top to bottom; a module may import its own layer and those below
LAYERS: tuple[tuple[str, ...], ...] = (
    ("ortpa.cli", "ortpa.__main__", "ortpa.demo", "ortpa.bench"),
    ("ortpa.serve",),
    ("ortpa.conversion",),  # the one conversion path: export, rewrite, checks, verification, deployment files
    ("ortpa.deploy", "ortpa.stages"),
    ("ortpa.parity",),
    ("ortpa.rewriter", "ortpa.export"),
    ("ortpa.runtime", "ortpa.formats"),
    ("ortpa.ops",),
    ("ortpa.model",),
    ("ortpa.errors", "ortpa.dtypes", "ortpa.tolerances", "ortpa.providers", "ortpa.extras", "ortpa.progress"),
)
OUTSIDE = ("ortpa.testing",)  # test models: nothing the product runs imports them


def _modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str], *, typing: bool) -> set[str]:
    """The ortpa modules ``name`` imports: those that run (``typing=False``) or those under TYPE_CHECKING only."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    typing_only = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for stmt in block.body
        for n in ast.walk(stmt)
    }
    for node in ast.walk(tree):
        if (id(node) in typing_only) != typing:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for t in targets:
            while t and t not in known:
                t = t.rsplit(".", 1)[0] if "." in t else ""
            if t and t != name and t.startswith("ortpa"):
                found.add(t)
    return found


@functools.cache  # one parse of the package per test session (read-only results)
def _graph(*, typing: bool = False) -> dict[str, set[str]]:
    """Module -> the modules it imports when it runs; with ``typing``, those its TYPE_CHECKING imports add."""
    mods = _modules()
    known = set(mods)
    graph = {n: _imports(n, p, known, typing=False) for n, p in mods.items()}
    if typing:
        for n, p in mods.items():
            graph[n] |= _imports(n, p, known, typing=True)
    # a package's __init__ re-exporting its modules is not an edge back from them
    return {
        n: {t for t in deps if not (n.startswith(t + ".") and t in mods and mods[t].name == "__init__.py")}
        for n, deps in graph.items()
    }


def _layer(module: str) -> int | None:
    for i, group in enumerate(LAYERS):
        if any(module == g or module.startswith(g + ".") for g in group):
            return i
    return None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, sccs, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sccs


def test_no_import_cycles():
    assert not (found := _cycles(_graph())), f"import cycles: {found}"


def test_no_type_only_cycles():
    """A knot tied by ``if TYPE_CHECKING:`` imports is still a knot."""
    assert not (found := _cycles(_graph(typing=True))), f"import cycles through TYPE_CHECKING imports: {found}"


def test_the_checks_can_fail(tmp_path):
    """The readers see what they must: a cycle, a type-only import apart from a running one, the layer order."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    source = tmp_path / "a.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ortpa.errors import OrtpaError\n"
        "if TYPE_CHECKING:\n"
        "    from ortpa.ops.spec import OpSpec\n"
        "def f():\n"
        "    from ortpa.dtypes import onnx_elem_type\n"
    )
    known = {"ortpa.a", "ortpa.errors", "ortpa.ops.spec", "ortpa.dtypes", "ortpa"}
    assert _imports("ortpa.a", source, known, typing=False) == {"ortpa.errors", "ortpa.dtypes"}
    assert _imports("ortpa.a", source, known, typing=True) == {"ortpa.ops.spec"}
    assert _layer("ortpa.rewriter.layer") < _layer("ortpa.runtime.session") < _layer("ortpa.ops.spec")
    assert _layer("ortpa.ops.spec") < _layer("ortpa.providers")


def test_layers_import_downward_only():
    bad = []
    for module, deps in sorted(_graph().items()):
        here = _layer(module)
        for dep in sorted(deps):
            if dep.startswith(OUTSIDE) and not module.startswith(OUTSIDE) and _layer(module) not in (0,):
                bad.append(f"{module} -> {dep} (test-only models)")
            there = _layer(dep)
            if here is not None and there is not None and there < here:
                bad.append(f"{module} -> {dep}")
    assert not bad, "imports upward:\n" + "\n".join(bad)


def test_every_module_has_a_layer():
    missing = [m for m in _graph() if m != "ortpa" and _layer(m) is None and not m.startswith(OUTSIDE)]
    assert not missing, f"modules outside every layer (add them to LAYERS and docs/architecture.md): {missing}"
