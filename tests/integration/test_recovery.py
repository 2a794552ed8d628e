"""A stalled stream's check (gateway/sessions/recovery.py) against real Redis and a real Celery broker: lost state is
named, a queued session is left alone, a live owner is left alone, a dead owner's session is re-sent once."""

from __future__ import annotations

import asyncio
import os
from types import SimpleNamespace

import pytest
import redis
import redis.asyncio as aioredis

from gateway.fleet.cache import Cached
from gateway.errors import RequestLost
from gateway.sessions.recovery import check_stalled
from services import protocol
from services.celery_app import create_celery_app
from services.config import Settings

REQUEST = "chatcmpl-recovery"


def heartbeat(worker_id: str, pid: int) -> bytes:
    return protocol.Heartbeat(worker_id=worker_id, role="draft", pool="cpu", pid=pid).encode()


def queued_tasks(client, pool: str = "cpu") -> int:
    return sum(client.llen(key) for key in client.scan_iter(match=f"{protocol.draft_queue(pool)}*")
               if client.type(key) == b"list")


@pytest.fixture
def world(redis_url):
    client = redis.Redis.from_url(redis_url)
    client.set(protocol.request_key(REQUEST), protocol.SessionSpec(REQUEST, [1, 2], 8).encode())
    yield client, Settings(redis_url=redis_url)


def check(settings: Settings, stalled_s: float = 2.0) -> bool:
    async def run() -> bool:
        state = SimpleNamespace(redis=aioredis.Redis.from_url(settings.redis_url), settings=settings,
                                celery=create_celery_app(settings), metrics=None, worker_cache=Cached(1.0))
        try:
            return await check_stalled(state, REQUEST, priority=1, stalled_s=stalled_s)
        finally:
            await state.redis.aclose()

    return asyncio.run(run())


def test_a_request_redis_lost_is_named(world):
    client, settings = world
    client.delete(protocol.request_key(REQUEST))
    with pytest.raises(RequestLost, match="lost by the queue"):
        check(settings)


def test_a_queued_session_and_a_live_owner_are_left_alone(world):
    client, settings = world
    assert check(settings) is False  # no owner yet: the task waits in the queue
    owner = protocol.instance_id("draft-a", os.getpid())
    client.set(protocol.owner_key(REQUEST), owner)
    client.set(protocol.heartbeat_key("draft-a"), heartbeat("draft-a", os.getpid()))
    assert check(settings) is False and queued_tasks(client) == 0


@pytest.mark.parametrize("restarted", [False, True], ids=["heartbeat-gone", "same-id-new-process"])
def test_a_dead_owner_is_revived_once_and_its_lease_released(world, restarted):
    client, settings = world
    dead = protocol.instance_id("draft-a", 4_000_001)
    client.set(protocol.owner_key(REQUEST), dead)
    client.set(protocol.lease_key(REQUEST), dead)
    if restarted:  # the supervisor started the worker again under the same id: a new pid heartbeats
        client.set(protocol.heartbeat_key("draft-a"), heartbeat("draft-a", 4_000_002))
    assert check(settings) is True
    assert client.get(protocol.lease_key(REQUEST)) is None
    assert queued_tasks(client) == 1
    assert check(settings) is False and queued_tasks(client) == 1  # one re-send per dead owner


def test_a_live_lease_of_another_process_is_never_released(world):
    client, settings = world
    client.set(protocol.owner_key(REQUEST), protocol.instance_id("draft-a", 4_000_001))
    live = protocol.instance_id("draft-b", os.getpid())
    client.set(protocol.lease_key(REQUEST), live)  # a newer owner already took it
    check(settings)
    assert client.get(protocol.lease_key(REQUEST)) == live.encode()


def test_a_task_lost_before_it_started_is_re_sent_once_draft_workers_have_room(world):
    """kill -9 between kombu's pop and its unacknowledged-index write loses a task: no owner ever."""
    client, settings = world
    assert check(settings, stalled_s=60) is False  # no draft worker with room (e.g. one restarting): wait
    client.set(protocol.heartbeat_key("draft-a"), heartbeat("draft-a", os.getpid()))
    assert check(settings, stalled_s=5) is False  # not long enough: it may be waiting its turn
    assert check(settings, stalled_s=60) is True and queued_tasks(client) == 1
    assert check(settings, stalled_s=61) is False and queued_tasks(client) == 1  # once per 30 s
