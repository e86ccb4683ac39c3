"""Prometheus metrics of the server (``GET /metrics``), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dsv41_requests", "finished requests by finish reason", ["finish"], registry=r)
        self.rejected = Counter("dsv41_requests_rejected", "requests refused because the queue was full", registry=r)
        self.cancelled = Counter("dsv41_requests_cancelled", "requests whose client went away", registry=r)
        self.prompt_tokens = Counter("dsv41_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("dsv41_generation_tokens", "tokens generated", registry=r)
        self.occupancy = Gauge("dsv41_batch_occupancy", "batch rows running a request", registry=r)
        self.batch_rows = Gauge("dsv41_batch_rows", "batch rows of the engine", registry=r)
        self.waiting = Gauge("dsv41_queue_waiting", "requests waiting for a row", registry=r)
        self.ttft = Histogram("dsv41_time_to_first_token_seconds", "arrival to first token", buckets=_LATENCY,
                              registry=r)
        self.itl = Histogram("dsv41_inter_token_latency_seconds", "time between tokens", buckets=_LATENCY,
                             registry=r)
        self.hits = Counter("dsv41_prefix_cache_hits", "prefix-cache hits by tier (device, host, disk) and "
                            "window state (live: resumed; replay: encoder bounded replay)", ["tier", "swa"],
                            registry=r)
        self.miss = Counter("dsv41_prefix_cache_misses", "prompts prefilled from position 0", registry=r)
        self.bytes = Gauge("dsv41_prefix_cache_bytes", "bytes held per tier", ["tier"], registry=r)

    def hit(self, tier: str, swa: str) -> None:
        self.hits.labels(tier=tier, swa=swa).inc()

    def cache_bytes(self, sizes: dict[str, int]) -> None:
        for tier, n in sizes.items():
            self.bytes.labels(tier=tier).set(n)

    def text(self) -> bytes:
        return generate_latest(self.registry)
