"""The telemetry service against real Redis and SQL: heartbeats in, routing table, events and history out."""

import time

import pytest
import redis

from services.config import Settings
from services.protocol import ROUTING_HISTORY_KEY, ROUTING_TABLE_KEY, Heartbeat, RoutingTable, heartbeat_key
from services.storage import crud
from services.storage.db import init_db, session_factory
from telemetry.service import TelemetryService


@pytest.fixture
def service(tmp_path, redis_url):
    client = redis.Redis.from_url(redis_url)
    db = session_factory(init_db(f"sqlite:///{tmp_path / 'telemetry.db'}"))
    settings = Settings(telemetry={"snapshot_interval_s": 1.0})
    yield TelemetryService(settings=settings, client=client, db=db), client, db


def put(client, worker_id, pool, **fields):
    beat = Heartbeat(worker_id=worker_id, role="verify", pool=pool, **fields)
    client.set(heartbeat_key(worker_id), beat.encode(), px=3000)


def test_tick_writes_table_events_and_snapshots(service):
    telemetry, client, db = service
    put(client, "g", "gpu", device_kind="cuda", temperature_c=91.0)
    put(client, "c", "cpu")
    now = time.time()
    events = telemetry.tick(now)
    table = RoutingTable.decode(client.get(ROUTING_TABLE_KEY))
    assert table.version == 1 and table.pool_weights == {"cpu": 1.0, "gpu": 0.0} and table.hot_workers == ["g"]
    assert {"worker_joined", "thermal_on", "routing_changed"} <= {e.kind for e in events}
    telemetry.tick(now + 0.5)  # nothing changed: same version, no snapshot yet (interval 1 s)
    assert RoutingTable.decode(client.get(ROUTING_TABLE_KEY)).version == 1
    client.delete(heartbeat_key("g"))
    telemetry.tick(now + 1.2)
    assert RoutingTable.decode(client.get(ROUTING_TABLE_KEY)).workers == ["c"]
    with db() as session:
        kinds = [e.kind for e in crud.list_events(session=session)]
        snapshots = crud.list_snapshots(session=session)
    assert "worker_dropped" in kinds and "thermal_on" in kinds
    assert sorted(s.worker_id for s in snapshots) == ["c", "c", "g"]  # at t and t + 1.2
    assert next(s for s in snapshots if s.worker_id == "g").temperature_c == 91.0
    # the dashboard's weights-over-time: one entry per version, newest first
    history = [RoutingTable.decode(raw) for raw in client.lrange(ROUTING_HISTORY_KEY, 0, -1)]
    assert [t.version for t in history] == [2, 1] and history[1].hot_workers == ["g"]
