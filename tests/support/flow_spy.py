"""What the per-sequence dataflow found at its sinks (the logits and every PagedAttention input), per conversion."""

from __future__ import annotations

from ortpa.rewriter.per_sequence import segments as per_sequence_segments


def record_sink_kinds(monkeypatch) -> list[set[str]]:
    """Patch the flow so that each conversion appends the set of kinds (``"token"``, ``"const"``, ``"route"``,
    ``"step"``...) its sinks came out with; the returned list fills as conversions run."""
    seen: list[set[str]] = []
    real = per_sequence_segments.run_flow

    def spy(graph, io):
        live, flow = real(graph, io)
        seen.append({flow.of(v).tag for v in per_sequence_segments._sinks(live, io)})
        return live, flow

    monkeypatch.setattr(per_sequence_segments, "run_flow", spy)
    return seen
