"""The gateway's Prometheus metrics, in a registry of its own."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    """The gateway's metrics (deploy/grafana's dashboard has a row of them)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "inferline_gateway_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.in_flight = Gauge(
            "inferline_gateway_in_flight", "Requests waiting on the fleet", registry=r
        )
        self.streams_open = Gauge(
            "inferline_gateway_streams_open",
            "Streamed responses (SSE) open: headers sent, the last event not yet",
            registry=r,
        )
        self.ttft = Histogram(
            "inferline_gateway_ttft_seconds",
            "Request received to first streamed text",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.duration = Histogram(
            "inferline_gateway_request_seconds",
            "Request received to the last byte",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cancels = Counter(
            "inferline_gateway_cancels", "Cancels sent for clients that hung up", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
