"""``GET /metrics``: the server's Prometheus metrics, in a registry of its own (two apps in one process, as in
tests or Ray replicas sharing a worker, never mix their figures)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["CONTENT_TYPE", "ServeMetrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# seconds; vLLM's buckets, trimmed: CPU decode steps of small models are a few ms
_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


class ServeMetrics:
    def __init__(self, num_blocks: int) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.running = Gauge("ortpa_requests_running", "Requests in the engine's running batch", registry=r)
        self.waiting = Gauge("ortpa_requests_waiting", "Requests queued for the engine, not yet running", registry=r)
        self.blocks_used = Gauge(
            "ortpa_kv_blocks_used", "KV blocks held by requests (cached blocks nobody reads count as free)", registry=r
        )
        self.blocks_total = Gauge("ortpa_kv_blocks_total", "KV blocks in the pool", registry=r)
        self.blocks_total.set(num_blocks)
        self.prompt_tokens = Counter("ortpa_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("ortpa_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "ortpa_requests_finished", "Engine requests finished, by reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter("ortpa_requests_rejected", "Requests refused with an error", ["status"], registry=r)
        self.ttft = Histogram(
            "ortpa_time_to_first_token_seconds", "Submission to first token", buckets=_TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "ortpa_inter_token_latency_seconds",
            "Time between two tokens of a request",
            buckets=_ITL_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
