"""The router's own Prometheus metrics (a private registry per router, so several routers can
live in one process, e.g. in tests)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.decisions = Counter("router_decisions_total", "Routing decisions", ["replica", "profile"], registry=r)
        self.requests = Counter("router_requests_total", "Client requests by final HTTP status", ["code"], registry=r)
        self.retries = Counter("router_retries_total", "Attempts retried on another replica", ["replica"], registry=r)
        self.rejected = Counter("router_rejected_total", "Requests refused with 429 (queue full)", registry=r)
        self.prefix_blocks = Counter("router_prefix_blocks_total", "Prompt blocks routed", registry=r)
        self.prefix_hit_blocks = Counter("router_prefix_hit_blocks_total",
                                         "Prompt blocks routed to a replica believed to cache them", registry=r)
        self.hit_ratio = Gauge("router_prefix_hit_ratio", "prefix_hit_blocks / prefix_blocks", registry=r)
        self.queue_depth = Gauge("router_queue_depth", "Requests waiting for an in-flight slot", registry=r)
        self.inflight = Gauge("router_inflight_requests", "Requests being proxied", registry=r)
        self.decision_latency = Histogram(
            "router_decision_latency_seconds", "Time to pick a replica", registry=r,
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1))
        self.ttft = Histogram("router_time_to_first_byte_seconds", "Router-observed time to first response byte",
                              registry=r, buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
        labels = ["replica"]
        self.r_healthy = Gauge("router_replica_healthy", "1 if the replica passes health checks", labels, registry=r)
        self.r_queue = Gauge("router_replica_queue", "Scraped waiting requests", labels, registry=r)
        self.r_running = Gauge("router_replica_running", "Scraped running requests", labels, registry=r)
        self.r_kv = Gauge("router_replica_kv_usage", "Scraped KV cache utilisation (0-1)", labels, registry=r)
        self.r_inflight = Gauge("router_replica_inflight", "Router's in-flight requests", labels, registry=r)
        self.r_pending = Gauge("router_replica_pending_tokens",
                               "Router's in-flight uncached prompt tokens awaiting a first token", labels, registry=r)

    def forget_replica(self, name: str) -> None:
        self._forget(name, (self.r_healthy, self.r_queue, self.r_running, self.r_kv, self.r_inflight, self.r_pending))

    def forget_scraped(self, name: str) -> None:
        """Drop a replica's scraped gauges (it is down: their last values are stale)."""
        self._forget(name, (self.r_queue, self.r_running, self.r_kv))

    @staticmethod
    def _forget(name: str, gauges: tuple[Gauge, ...]) -> None:
        for g in gauges:
            try:
                g.remove(name)
            except KeyError:
                pass
