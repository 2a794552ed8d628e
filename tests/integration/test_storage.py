"""Storage on SQLite (default) and PostgreSQL (this machine's server, database `test`)."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import inspect, text

from services.storage import crud
from services.storage.db import create_db_engine, init_db, session_factory

POSTGRES_URL = os.environ.get("MIRROR_SD_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")


def _postgres_available() -> bool:
    try:
        with create_db_engine(POSTGRES_URL).connect() as connection:
            connection.execute(text("SELECT 1"))
        return True
    except Exception:
        return False


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'nested' / 'mirror.db'}"
    else:
        if not _postgres_available():
            if os.environ.get("CI"):
                pytest.fail(f"PostgreSQL not reachable at {POSTGRES_URL}")
            pytest.skip("PostgreSQL not reachable")
        url = POSTGRES_URL
        engine = create_db_engine(url)
        with engine.begin() as connection:  # a clean slate: this database belongs to the tests
            for table in ("telemetry_snapshots", "events", "requests", "api_keys", "alembic_version"):
                connection.execute(text(f"DROP TABLE IF EXISTS {table} CASCADE"))
        engine.dispose()
    engine = init_db(url)
    yield session_factory(engine)
    engine.dispose()


def test_migrations_create_the_tables_and_are_idempotent(db):
    engine = db.kw["bind"]
    assert {"api_keys", "requests", "events", "telemetry_snapshots", "alembic_version"} <= set(
        inspect(engine).get_table_names())
    init_db(engine.url.render_as_string(hide_password=False))  # second run: nothing to do, no error


def test_api_keys_are_stored_hashed(db):
    with db() as session:
        row, key = crud.create_api_key(session=session, name="ci", priority="high")
        assert key.startswith("msd-") and key not in (row.key_hash, row.key_prefix)
        assert crud.get_api_key(session=session, key=key).priority == "high"
        assert crud.get_api_key(session=session, key=key + "x") is None
        assert crud.revoke_api_key(session=session, key_id=row.id)
        assert crud.get_api_key(session=session, key=key) is None
        with pytest.raises(ValueError, match="priority must be one of high, normal, low, got 'urgent'"):
            crud.create_api_key(session=session, name="x", priority="urgent")


def test_request_lifecycle_and_events(db):
    with db() as session:
        crud.create_request(session=session, request_id="cmpl-1", model="m", endpoint="completions",
                            prompt_tokens=5, params={"max_tokens": 8}, priority="normal", route="sd",
                            pool="cpu", api_key_id=None)
        crud.update_request(session=session, request_id="cmpl-1", status="finished", completion_tokens=8,
                            num_drafts=3, num_draft_tokens=12, num_accepted_tokens=6)
        row = crud.get_request(session=session, request_id="cmpl-1")
        assert (row.status, row.completion_tokens, row.params) == ("finished", 8, {"max_tokens": 8})
        with pytest.raises(ValueError, match="no column 'bogus'"):
            crud.update_request(session=session, request_id="cmpl-1", bogus=1)
        crud.record_event(session=session, kind="cancelled", request_id="cmpl-1", detail={"by": "client"})
        crud.record_event(session=session, kind="other")
        events = crud.list_events(session=session, request_id="cmpl-1")
        assert [e.kind for e in events] == ["cancelled"] and events[0].detail == {"by": "client"}


def test_a_worker_record_never_undoes_a_client_cancel(db):
    with db() as session:
        for request_id in ("cmpl-kept", "cmpl-left"):
            crud.create_request(session=session, request_id=request_id, model="m", endpoint="chat",
                                prompt_tokens=5, params={}, priority="normal", route="sd", pool="cpu",
                                api_key_id=None)
        crud.update_request(session=session, request_id="cmpl-left", status="cancelled", finish_reason="cancelled")
        for request_id in ("cmpl-kept", "cmpl-left"):  # the worker starts, then ends its generation
            crud.record_work(session=session, request_id=request_id, status="running")
            crud.record_work(session=session, request_id=request_id, status="finished", finish_reason="length",
                             completion_tokens=8, num_drafts=2)
        rows = {r: crud.get_request(session=session, request_id=r) for r in ("cmpl-kept", "cmpl-left")}
        session.expire_all()
        assert [(rows[r].status, rows[r].finish_reason, rows[r].completion_tokens, rows[r].num_drafts)
                for r in ("cmpl-kept", "cmpl-left")] == [("finished", "length", 8, 2), ("cancelled", "cancelled", 8, 2)]
        with pytest.raises(ValueError, match="no column 'bogus'"):
            crud.record_work(session=session, request_id="cmpl-kept", bogus=1)


def test_a_row_its_draft_worker_left_open_is_closed_from_the_last_event_its_gateway_read(db):
    """A draft worker killed mid-request leaves its row running (or queued, when it never opened the session);
    the verify worker finishes the session on its own, and the gateway that read the last event closes the row
    from it. A row its driver closed keeps its driver's record, and a task opening the session later does not
    open the row again. Each row says who wrote its ending; a driver's record arriving after the stream's ending
    (the driver was slow, not dead) replaces it."""
    import asyncio
    from types import SimpleNamespace

    from gateway.sessions.ending import close_open_row
    from services.protocol import OutputEvent
    from services.speculative.stats import SpecDecodingStats

    with db() as session:
        for request_id in ("cmpl-running", "cmpl-queued", "cmpl-driven"):
            crud.create_request(session=session, request_id=request_id, model="m", endpoint="chat",
                                prompt_tokens=5, params={}, priority="normal", route="sd", pool="cpu",
                                api_key_id=None)
        crud.record_work(session=session, request_id="cmpl-running", status="running")
        crud.record_work(session=session, request_id="cmpl-driven", status="finished", finish_reason="stop",
                         completion_tokens=40, num_drafts=9, transport_ms_p50=3.5,
                         recorded_by=crud.RECORDED_BY_DRIVER)
        assert crud.get_request(session=session, request_id="cmpl-running").recorded_by is None  # no ending yet
    last = OutputEvent(request_id="", seq=47, token_ids=[1], num_output_tokens=48, finished=True,
                       finish_reason="length", stats=SpecDecodingStats(num_drafts=6, num_draft_tokens=30,
                                                                       num_accepted_tokens=25))
    for request_id in ("cmpl-running", "cmpl-queued", "cmpl-driven"):
        asyncio.run(close_open_row(SimpleNamespace(db=db), request_id, last=last, first_token_at=None))
    with db() as session:
        crud.record_work(session=session, request_id="cmpl-queued", status="running")  # a redelivered task, late
        rows = {r: crud.get_request(session=session, request_id=r) for r in ("cmpl-running", "cmpl-queued",
                                                                             "cmpl-driven")}
        assert [(row.status, row.finish_reason, row.completion_tokens, row.num_drafts, row.num_draft_tokens,
                 row.num_accepted_tokens, row.finished_at is not None) for row in rows.values()] == [
            ("finished", "length", 48, 6, 30, 25, True), ("finished", "length", 48, 6, 30, 25, True),
            ("finished", "stop", 40, 9, 0, 0, False)]
        assert rows["cmpl-driven"].transport_ms_p50 == 3.5
        assert [row.recorded_by for row in rows.values()] == ["stream", "stream", "driver"]
        crud.record_work(session=session, request_id="cmpl-running", status="finished", finish_reason="length",
                         completion_tokens=48, transport_ms_p50=2.0, recorded_by=crud.RECORDED_BY_DRIVER)
        session.expire_all()
        row = crud.get_request(session=session, request_id="cmpl-running")
        assert (row.status, row.transport_ms_p50, row.recorded_by) == ("finished", 2.0, "driver")


def test_telemetry_snapshots(db):
    row = {"worker_id": "w1", "role": "verify", "pool": "gpu", "device_kind": "cuda", "utilization": 0.5,
           "temperature_c": 90.0, "acceptance_rate": None, "latency_p99_ms": 12.5, "num_sessions": 2,
           "queue_depth": 0, "routing_version": 3}
    with db() as session:
        assert crud.record_snapshots(session=session, rows=[row, {**row, "worker_id": "w2"}]) == 2
        snapshots = crud.list_snapshots(session=session, worker_id="w1")
        assert [(s.temperature_c, s.routing_version) for s in snapshots] == [(90.0, 3)]


def test_a_verify_worker_drafting_for_its_own_sessions_records_them_as_their_driver(db):
    """Placement local: the verify worker drives its sessions, and its recorder thread writes their rows."""
    from types import SimpleNamespace

    from services.engine.draft_session import SessionSummary
    from services.speculative.stats import SpecDecodingStats
    from verify_worker.records import Recorder

    with db() as session:
        crud.create_request(session=session, request_id="cmpl-local", model="m", endpoint="chat", prompt_tokens=5,
                            params={}, priority="normal", route="sd", pool="cpu", api_key_id=None)
    stats = SpecDecodingStats(num_drafts=4, num_draft_tokens=16, num_accepted_tokens=12)
    summary = SessionSummary("cmpl-local", "length", 20, 5, stats, [], 1.0, 0, plain_reason="cost")
    recorder = Recorder(db)
    recorder.start()
    recorder.started("cmpl-local")
    recorder.ended(SimpleNamespace(request_id="cmpl-local", summary=lambda: summary), num_output_tokens=19)
    recorder.close()
    recorder.join(timeout=10)
    with db() as session:
        row = crud.get_request(session=session, request_id="cmpl-local")
        assert (row.status, row.finish_reason, row.completion_tokens, row.num_drafts, row.num_accepted_tokens,
                row.plain_reason, row.recorded_by) == ("finished", "length", 19, 4, 12, "cost", "driver")
        assert row.started_at is not None and row.first_token_at is not None and row.finished_at is not None


def test_a_sqlite_file_is_written_ahead_and_read_by_a_second_engine_as_the_first_writes(tmp_path):
    url = f"sqlite:///{tmp_path / 'db' / 'mirror.db'}"
    writer, reader = init_db(url), create_db_engine(url)
    with writer.connect() as connection:
        assert connection.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert connection.execute(text("PRAGMA synchronous")).scalar() == 1  # NORMAL
    with writer.begin() as connection:
        connection.execute(text("CREATE TABLE probe (x INTEGER)"))
    with writer.begin() as connection:  # a write in flight does not block a reader (another process's engine)
        connection.execute(text("INSERT INTO probe VALUES (1)"))
        with reader.connect() as other:
            assert other.execute(text("SELECT count(*) FROM probe")).scalar() == 0
    with reader.connect() as other:
        assert other.execute(text("SELECT count(*) FROM probe")).scalar() == 1
