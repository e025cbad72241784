"""``GET /metrics``: the server's Prometheus metrics, in a registry of its own (two apps in one process, as in
tests or Ray replicas sharing a worker, never mix their figures).

:data:`SERIES` declares every series (name, type, labels, meaning); :class:`ServeMetrics` builds them from it, and
``docs/serve.md``'s table of metrics is checked against it and against what ``/metrics`` renders
(``tests/serve/test_metrics_docs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "SERIES", "Series", "ServeMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; vLLM's buckets, trimmed: CPU decode steps of small models are a few ms
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_KINDS = {"gauge": Gauge, "counter": Counter, "histogram": Histogram}


@dataclass(frozen=True)
class Series:
    """One metric: ``attr`` on :class:`ServeMetrics`; ``name`` as scraped (a counter's ends in ``_total``)."""

    attr: str
    name: str
    kind: str  # gauge, counter, histogram
    help: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    @property
    def base(self) -> str:
        """The name prometheus_client is given (it adds ``_total`` to a counter's)."""
        return self.name.removesuffix("_total") if self.kind == "counter" else self.name


SERIES: tuple[Series, ...] = (
    Series("running", "ortpa_requests_running", "gauge", "Requests in the engine's running batch"),
    Series("waiting", "ortpa_requests_waiting", "gauge", "Requests queued for the engine, not yet running"),
    Series(
        "blocks_used",
        "ortpa_kv_blocks_used",
        "gauge",
        "KV blocks held by requests (cached blocks nobody reads count as free)",
    ),
    Series("blocks_total", "ortpa_kv_blocks_total", "gauge", "KV blocks in the pool"),
    Series("prompt_tokens", "ortpa_prompt_tokens_total", "counter", "Prompt tokens of admitted requests"),
    Series("generated_tokens", "ortpa_generation_tokens_total", "counter", "Tokens generated"),
    Series(
        "finished",
        "ortpa_requests_finished_total",
        "counter",
        "Engine requests finished, by reason",
        ("finish_reason",),
    ),
    Series("rejected", "ortpa_requests_rejected_total", "counter", "Requests refused with an error", ("status",)),
    Series(
        "ttft",
        "ortpa_time_to_first_token_seconds",
        "histogram",
        "Submission to first token",
        buckets=_TTFT_BUCKETS,
    ),
    Series(
        "itl",
        "ortpa_inter_token_latency_seconds",
        "histogram",
        "Time between two tokens of a request",
        buckets=_ITL_BUCKETS,
    ),
)


class ServeMetrics:
    """The series of :data:`SERIES` as attributes (``metrics.rejected.labels("413").inc()``)."""

    running: Gauge
    waiting: Gauge
    blocks_used: Gauge
    blocks_total: Gauge
    prompt_tokens: Counter
    generated_tokens: Counter
    finished: Counter
    rejected: Counter
    ttft: Histogram
    itl: Histogram

    def __init__(self, num_blocks: int) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        for s in SERIES:
            extra = {"buckets": s.buckets} if s.buckets else {}
            metric = _KINDS[s.kind](s.base, s.help, list(s.labels), registry=self.registry, **extra)
            setattr(self, s.attr, metric)
        self.blocks_total.set(num_blocks)

    def render(self) -> bytes:
        return generate_latest(self.registry)
