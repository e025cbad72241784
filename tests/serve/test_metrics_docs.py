"""docs/serve.md's table of metrics against the code: the same series, types, labels and meanings as
``ortpa.serve.metrics.SERIES`` declares, and as ``/metrics`` renders them (so neither can drift from the docs)."""

from __future__ import annotations

import re

from ortpa.serve.metrics import SERIES, ServeMetrics
from serve.helpers import ROOT


def _documented() -> dict[str, tuple[str, tuple[str, ...], str]]:
    """Rows of the table under '## Metrics': name -> (type, labels, meaning)."""
    text = (ROOT / "docs" / "serve.md").read_text()
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].startswith("`ortpa_"):
            continue
        labels = tuple(re.findall(r"`(\w+)`", cells[2]))
        rows[cells[0].strip("`")] = (cells[1], labels, cells[3])
    return rows


def _rendered(metrics: ServeMetrics) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Families of the exposition (name -> type, ``_created`` ones aside) and the label names of their samples."""
    text = metrics.render().decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M))
    types = {n: t for n, t in types.items() if not n.endswith("_created")}
    labels: dict[str, set[str]] = {n: set() for n in types}
    for name, inner in re.findall(r"^(\w+)\{([^}]*)\}", text, flags=re.M):
        family = next((f for f in types if name == f or name.startswith(f + "_")), None)
        if family is not None:
            labels[family] |= {k for k in re.findall(r'(\w+)="', inner) if k != "le"}
    return types, labels


def test_docs_list_every_metric_as_the_code_renders_it():
    metrics = ServeMetrics(num_blocks=8)
    for s in SERIES:  # a sample of every labelled series, so its labels show in the exposition
        metric = getattr(metrics, s.attr)
        if s.labels:
            metric = metric.labels(*["x"] * len(s.labels))
        if s.kind == "histogram":
            metric.observe(0.01)
        elif s.kind == "counter":
            metric.inc()
        else:
            metric.set(1)
    types, labels = _rendered(metrics)
    assert types == {s.name: s.kind for s in SERIES}
    assert labels == {s.name: set(s.labels) for s in SERIES}
    documented = _documented()
    assert set(documented) == set(types), f"docs/serve.md's metrics differ from the code: {sorted(documented)}"
    for s in SERIES:
        kind, doc_labels, meaning = documented[s.name]
        assert kind == s.kind and doc_labels == s.labels, (s.name, documented[s.name])
        assert meaning.startswith(s.help), f"{s.name}: docs say {meaning!r}, the code's help is {s.help!r}"
