"""The telemetry service: heartbeats -> fallback rules -> versioned routing table in Redis, events in SQL."""

from __future__ import annotations

import logging
import threading
import time

import redis

from services.config import Settings
from services.protocol import ROUTING_HISTORY_KEY, ROUTING_HISTORY_LEN, ROUTING_TABLE_KEY, Heartbeat
from services.redis_client import read_heartbeats, read_routing_table
from services.storage import crud
from telemetry.metrics import TelemetryMetrics
from telemetry.rules import RuleEvent, evaluate

logger = logging.getLogger(__name__)


class TelemetryService:
    def __init__(self, *, settings: Settings, client: redis.Redis, db=None,
                 metrics: TelemetryMetrics | None = None) -> None:
        self.settings = settings
        self.client = client
        self.db = db
        self.metrics = metrics or TelemetryMetrics()
        self._last_snapshot = 0.0
        self.table = read_routing_table(client)

    def tick(self, now: float | None = None) -> list[RuleEvent]:
        now = now if now is not None else time.time()
        beats = read_heartbeats(self.client)
        table, events = evaluate(beats, self.table, self.settings.telemetry, now)
        if self.table is None or table.version != self.table.version:
            encoded = table.encode()
            with self.client.pipeline(transaction=False) as pipe:
                pipe.set(ROUTING_TABLE_KEY, encoded)
                pipe.lpush(ROUTING_HISTORY_KEY, encoded)
                pipe.ltrim(ROUTING_HISTORY_KEY, 0, ROUTING_HISTORY_LEN - 1)
                pipe.execute()
        else:
            table.version = self.table.version
        self.table = table
        self.metrics.observe(table, events)
        for event in events:
            logger.info("telemetry event %s worker=%s %s", event.kind, event.worker_id, event.detail)
        self._record(events)
        interval = self.settings.telemetry.snapshot_interval_s
        if interval and now - self._last_snapshot >= interval:
            self._last_snapshot = now
            self._snapshot(beats, table.version)
        return events

    def _snapshot(self, beats: list[Heartbeat], routing_version: int) -> None:
        if self.db is None or not beats:
            return
        rows = [{"worker_id": b.worker_id, "role": b.role, "pool": b.pool, "device_kind": b.device_kind,
                 "utilization": b.utilization, "temperature_c": b.temperature_c,
                 "acceptance_rate": b.acceptance_rate, "latency_p99_ms": b.latency_p99_ms,
                 "num_sessions": b.num_sessions, "queue_depth": b.queue_depth, "routing_version": routing_version}
                for b in beats]
        try:
            with self.db() as session:
                crud.record_snapshots(session=session, rows=rows)
        except Exception:  # history must not stop routing
            logger.exception("could not record telemetry snapshots")

    def _record(self, events: list[RuleEvent]) -> None:
        if self.db is None or not events:
            return
        try:
            with self.db() as session:
                for event in events:
                    crud.record_event(session=session, kind=event.kind, worker_id=event.worker_id,
                                      detail={**event.detail, **({"pool": event.pool} if event.pool else {})})
        except Exception:  # the routing table matters more than its history
            logger.exception("could not record telemetry events")

    def serve(self, stop: threading.Event) -> None:
        interval = self.settings.telemetry.interval_s
        while not stop.is_set():
            try:
                self.tick()
            except (redis.ConnectionError, redis.TimeoutError) as exc:  # an outage: the next tick tries again
                logger.warning("telemetry tick skipped: Redis unreachable (%s)", exc)
            except redis.RedisError:
                logger.exception("telemetry tick failed")
            stop.wait(interval)
