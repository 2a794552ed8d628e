"""Redis or the database away for a moment, or Redis busy with a burst, as an operator meets them (a `mirror-sd
drill chaos --restart-redis` and a 500-request `drill burst` found the Redis ones): sending a session's task waits
out a short restart, a broker or a database away for longer is a 503 with Retry-After (never a 500), and a draft
worker's task threads can all block on Redis at once.

Real Redis servers (the machine's, and a private one that is stopped and started), a real gateway app, real
Celery apps, and a real database connection refused."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from fastapi.testclient import TestClient

from draft_worker.runtime import draft_client
from gateway.app import create_app
from services.celery_app import create_celery_app
from services.config import Settings
from services.protocol import DraftBlock, Heartbeat, cancel_key, heartbeat_key
from services.stack import PrivateRedis, free_port
from services.protocol import verify_pool_queue
from services.storage import crud
from services.storage.db import create_db_engine, init_db, session_factory

QUEUE = "draft.cpu"


@pytest.fixture
def private_redis():
    server = PrivateRedis().start()
    yield server
    server.stop()


def test_a_session_task_sent_while_redis_restarts_waits_for_it_and_is_delivered(private_redis):
    """kombu's own retry gives up after about 0.6 s; a restart takes longer (0.9 s in the drill)."""
    app = create_celery_app(Settings(redis_url=private_redis.url))
    # ignore_result, as the gateway sends it: no result subscription, which the server's stop at teardown would
    # leave for a later test's garbage collection to close (20 s of reconnects, and a warning, there)
    app.send_task("mirror_sd.draft.run_session", args=["warm"], queue=QUEUE, task_id="warm",
                  ignore_result=True)  # connected once
    client = redis.Redis.from_url(private_redis.url)
    client.shutdown(nosave=False)
    private_redis.process.wait(timeout=10)
    restarted = threading.Timer(1.5, private_redis.start)
    restarted.start()
    started = time.monotonic()
    try:
        app.send_task("mirror_sd.draft.run_session", args=["during"], queue=QUEUE, task_id="during",
                      ignore_result=True)
    finally:
        restarted.join()
    assert time.monotonic() - started >= 1.0  # it waited for the server ...
    queued = b"".join(redis.Redis.from_url(private_redis.url).lrange(QUEUE, 0, -1))
    assert b"during" in queued  # ... and the task is there for a draft worker


def serving(tmp_path, redis_url) -> tuple[Settings, redis.Redis]:
    """Settings of a gateway over a real SQLite file and `redis_url`, where a verify and a draft worker
    heartbeat (so a request goes as far as starting its session)."""
    database_url = f"sqlite:///{tmp_path / 'outage.db'}"
    init_db(database_url)
    client = redis.Redis.from_url(redis_url)
    for worker_id, role in (("verify-cpu-0", "verify"), ("draft-cpu", "draft")):
        client.set(heartbeat_key(worker_id), Heartbeat(worker_id=worker_id, role=role, pool="cpu").encode(),
                   px=30_000)
    return Settings(redis_url=redis_url, database_url=database_url, gateway={"auth_disabled": True}), client


HELLO = {"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}


def test_a_broker_away_past_the_retries_is_a_503_with_retry_after_and_its_opened_session_is_cancelled(
        tmp_path, redis_url):
    """The gateway sends an opened session's round 0 before its task (SessionSpec.opened): when the task cannot
    be sent, the round is at the verify pool already, so the request's cancellation must follow it."""
    settings, client = serving(tmp_path, redis_url)
    client.set(heartbeat_key("draft-cpu"), Heartbeat(worker_id="draft-cpu", role="draft", pool="cpu",
                                                     plain_opening_tokens=1).encode(), px=30_000)  # it opens
    with TestClient(create_app(settings)) as http:
        # the session's task goes to a broker nobody answers (the spec's Redis answers): a real refusal
        away = create_celery_app(Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
        away.conf.task_publish_retry_policy = {"max_retries": 1, "interval_start": 0.0, "interval_step": 0.1,
                                               "interval_max": 0.1}
        http.app.state.gateway.celery = away
        answer = http.post("/v1/chat/completions", json=HELLO)
    assert answer.status_code == 503, answer.text
    message = answer.json()["error"]["message"]
    assert answer.headers["Retry-After"] and message == "the queue is unavailable (ConnectionError); retry shortly"
    opening = DraftBlock.decode(client.lindex(verify_pool_queue("cpu"), 0))
    assert opening.round == 0 and client.llen(verify_pool_queue("cpu")) == 1
    assert client.exists(cancel_key(opening.request_id))  # a verify worker taking it stops at its next look
    with session_factory(create_db_engine(settings.database_url))() as session:
        row = crud.get_request(session=session, request_id=opening.request_id)
        assert (row.status, row.recorded_by) == ("cancelled", crud.RECORDED_BY_CLIENT)  # no driver will follow


def test_a_database_away_is_a_503_with_retry_after_and_nothing_of_the_request_is_sent(tmp_path, redis_url):
    """A PostgreSQL restart (or SQLite locked past its timeout) while a request starts: its row is written first,
    so it is refused before its spec or any block or task reaches Redis. It was a 500."""
    settings, client = serving(tmp_path, redis_url)
    with TestClient(create_app(settings)) as http:
        down = create_db_engine(f"postgresql://postgres@127.0.0.1:{free_port()}/test")  # nothing listens there
        http.app.state.gateway.db = session_factory(down)
        answer = http.post("/v1/chat/completions", json=HELLO)
    assert answer.status_code == 503, answer.text
    message = answer.json()["error"]["message"]
    assert answer.headers["Retry-After"] and message == "the database is unavailable (OperationalError); retry shortly"
    assert client.keys("mirror-sd:request:*") == [] and client.llen(verify_pool_queue("cpu")) == 0
    assert client.llen(QUEUE) == 0


def test_every_task_thread_of_a_draft_worker_can_block_on_redis_at_once(redis_url):
    """128 task threads (worker.draft_concurrency) each in a blocking read, as a burst's openings are: redis-py 8's
    default pool of 100 refused the rest ("Too many connections")."""
    settings = Settings(redis_url=redis_url)
    client = draft_client(settings)
    key = "mirror-sd:test:nothing-comes"
    client.delete(key)
    errors: list[Exception] = []
    barrier = threading.Barrier(settings.worker.draft_concurrency)

    def wait_for_nothing() -> None:
        barrier.wait()
        try:
            client.blpop([key], timeout=1)
        except redis.RedisError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait_for_nothing) for _ in range(settings.worker.draft_concurrency)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
    finally:
        client.close()
    assert settings.worker.draft_concurrency > 100 and errors == [], errors[:3]
