"""Prometheus metrics of the telemetry service: the routing table and the rule events."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge

from services.protocol import RoutingTable
from telemetry.rules import RuleEvent

logger = logging.getLogger(__name__)


class TelemetryMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.pool_weight = Gauge("mirror_sd:routing_pool_weight", "Share of new sessions per pool", ["pool"],
                                 registry=r)
        self.version = Gauge("mirror_sd:routing_table_version", "Routing table version", registry=r)
        self.workers = Gauge("mirror_sd:routing_workers", "Live verify workers in the table", registry=r)
        self.hot = Gauge("mirror_sd:routing_hot_workers", "Workers over the thermal limit", registry=r)
        self.alerts = Gauge("mirror_sd:routing_rejection_alerts", "Workers over the rejection limit", registry=r)
        self.events = Counter("mirror_sd:telemetry_events", "Rule events", ["kind"], registry=r)

    def observe(self, table: RoutingTable, events: list[RuleEvent]) -> None:
        for pool, weight in table.pool_weights.items():
            self.pool_weight.labels(pool).set(weight)
        self.version.set(table.version)
        self.workers.set(len(table.workers))
        self.hot.set(len(table.hot_workers))
        self.alerts.set(len(table.alerts))
        for event in events:
            self.events.labels(event.kind).inc()


def serve_metrics(metrics: TelemetryMetrics, host: str, port: int) -> bool:
    """Expose /metrics; a busy port is logged, not fatal (the routing table matters more)."""
    if port == 0:
        return False
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr=host, registry=metrics.registry)
    except OSError as exc:
        logger.warning("telemetry metrics not served on %s:%d: %s", host, port, exc)
        return False
    logger.info("telemetry metrics on http://%s:%d/metrics", host, port)
    return True
