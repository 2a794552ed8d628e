"""The dashboard's endpoints in a real gateway app over real Redis and SQL (no workers: heartbeats, table
and history are written as the workers and the telemetry service write them)."""

from __future__ import annotations

import time

import pytest
import redis
from fastapi.testclient import TestClient

from gateway.app import create_app
from services.config import Settings
from services.protocol import (
    ROUTING_HISTORY_KEY,
    ROUTING_TABLE_KEY,
    Heartbeat,
    LinkFigures,
    RoutingTable,
    heartbeat_key,
)
from services.speculative.stats import SpecDecodingStats
from services.storage import crud
from services.storage.db import init_db, session_factory


@pytest.fixture
def fleet(tmp_path, redis_url):
    client = redis.Redis.from_url(redis_url)
    database_url = f"sqlite:///{tmp_path / 'dash.db'}"
    db = session_factory(init_db(database_url))
    now = time.time()
    for worker_id, pool, kind, temp in (("verify-accel-0", "accel", "accelerator", 90.0),
                                        ("verify-cpu-0", "cpu", "cpu", None)):
        beat = Heartbeat(worker_id=worker_id, role="verify", pool=pool, device_kind=kind, temperature_c=temp,
                         utilization=0.4, num_sessions=2, kv_cache_bytes=3 << 20, queue_depth=1,
                         profile={"step_ms_32x1": 40.0}, overridden=["temperature_c"] if temp else [])
        client.set(heartbeat_key(worker_id), beat.encode(), px=30_000)
    link = LinkFigures(redis_rtt_ms=20.4, round_trip_ms_p50=61.0, round_trip_ms_p99=90.0, rounds=12, window=12,
                       blocks_ahead=3, verified_ahead=0.4, resent_blocks=2, failed_over_blocks=1)
    draft = Heartbeat(worker_id="draft-cpu", role="draft", pool="cpu", link=link)
    client.set(heartbeat_key("draft-cpu"), draft.encode(), px=30_000)
    old = RoutingTable(version=1, pool_weights={"accel": 0.5, "cpu": 0.5}, updated_at=now - 1000)
    mid = RoutingTable(version=2, pool_weights={"accel": 0.5, "cpu": 0.5}, updated_at=now - 20)
    hot = RoutingTable(version=3, pool_weights={"accel": 0.0, "cpu": 1.0}, hot_workers=["verify-accel-0"],
                       workers=["verify-accel-0", "verify-cpu-0"], updated_at=now - 2)
    for table in (old, mid, hot):
        client.lpush(ROUTING_HISTORY_KEY, table.encode())
    client.set(ROUTING_TABLE_KEY, hot.encode())
    with db() as session:
        crud.record_event(session=session, kind="thermal_on", worker_id="verify-accel-0", detail={})
    yield redis_url, database_url


def app_client(redis_url: str, database_url: str, *, auth: bool) -> TestClient:
    settings = Settings(redis_url=redis_url, database_url=database_url,
                        gateway={"auth_disabled": not auth})
    return TestClient(create_app(settings))


def test_snapshot_has_workers_history_stats_and_events(fleet):
    with app_client(*fleet, auth=False) as client:
        state = client.app.state.gateway
        stats = SpecDecodingStats()
        stats.observe(3, 2)
        stats.observe(3, 0)
        state.metrics.live.add_tokens(7)
        state.metrics.live.observe_finished(ttft_s=0.25, stats=stats)
        time.sleep(1.05)  # the series holds whole seconds only
        snap = client.get("/v1/dashboard").json()
    workers = {w["worker_id"]: w for w in snap["workers"]}
    assert set(workers) == {"verify-accel-0", "verify-cpu-0", "draft-cpu"}
    accel = workers["verify-accel-0"]
    assert accel["hot"] and accel["temperature_c"] == 90.0 and accel["device_kind"] == "accelerator"
    assert accel["kv_cache_bytes"] == 3 << 20 and accel["queue_depth"] == 1 and "profile" not in accel
    assert not workers["verify-cpu-0"]["hot"] and workers["verify-cpu-0"]["link"] is None
    link = workers["draft-cpu"]["link"]  # the draft worker's link figures, for its row in the drafts table
    assert link["redis_rtt_ms"] == 20.4 and link["round_trip_ms_p99"] == 90.0 and link["blocks_ahead"] == 3
    assert (link["resent_blocks"], link["failed_over_blocks"]) == (2, 1)
    assert snap["routing"]["version"] == 3 and snap["routing"]["pool_weights"] == {"accel": 0.0, "cpu": 1.0}
    # the chart's window: the two versions inside it, after the last one before it
    assert [h["version"] for h in snap["routing_history"]] == [1, 2, 3]
    assert [p["rate"] for p in snap["acceptance_per_position"]] == [0.5, 0.5, 0.0]
    assert sum(r["tokens_per_s"] for r in snap["throughput"]) == 7
    assert snap["summary"]["ttft_ms_p50"] == 250.0
    assert snap["events"][0]["kind"] == "thermal_on"
    assert snap["gateway"]["inflight"] == 0


def test_page_is_public_the_data_follows_auth(fleet):
    with app_client(*fleet, auth=True) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and "dashboard/static/dashboard.js" in page.text
        assert "default-src 'self'" in page.headers["content-security-policy"]
        for asset in ("dashboard.js", "charts.js", "dashboard.css"):
            assert client.get(f"/dashboard/static/{asset}").status_code == 200
        assert client.get("/dashboard/static/../auth.py").status_code == 404
        assert client.get("/v1/dashboard").status_code == 401
        assert client.get("/v1/telemetry").status_code == 401
        state = client.app.state.gateway
        with state.db() as session:
            key = crud.create_api_key(session=session, name="ops", priority="low")[1]
        answer = client.get("/v1/dashboard", headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200 and answer.json()["routing"]["version"] == 3
