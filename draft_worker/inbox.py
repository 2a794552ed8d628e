"""The draft worker's inbox, read by blocking pops on a connection of its own.

Verdicts (and BlockTaken notes) of every session of the process arrive on
one Redis list. A listener thread keeps a blocking pop outstanding on it
(BLPOP, pipelined with an LPOP of up to INBOX_BATCH more: one round trip for
a batch, on Redis 6.2 too, which has no BLMPOP), so a verdict reaches the process
half a link trip after the verify worker pushes it, whatever the driver is
doing, and the driver looks for verdicts without a round trip: its turn
takes what has arrived, its speculation asks whether anything has, and it
sleeps on an event the listener sets. Per round the driver's only round trip
is then the push of its blocks.

Each message is stamped with its arrival (perf_counter), so the time a
verdict waited on the driver's other work is measured, not guessed.
A message popped and not yet applied when the process dies is lost, as one
popped by the driver itself would be: the session's block is sent again
(services/engine/draft_session.py, failover and deadlines).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

import redis

logger = logging.getLogger(__name__)

INBOX_BATCH = 256
BLOCK_S = 1.0  # one blocking pop's server-side wait; a stop is noticed within it


class InboxListener(threading.Thread):
    def __init__(self, client: redis.Redis, inbox: str, wake: threading.Event, stopping: threading.Event) -> None:
        super().__init__(daemon=True, name="draft-inbox")
        self.client = client  # a pool: the blocking pop holds a connection of its own
        self.inbox = inbox
        self.wake = wake
        self.stopping = stopping
        self._arrived: deque[tuple[bytes, float]] = deque()
        self.pops = 0  # blocking pops that returned messages

    def run(self) -> None:
        backoff = 0.0
        while not self.stopping.is_set():
            try:
                with self.client.pipeline(transaction=False) as pipe:
                    pipe.blpop([self.inbox], timeout=BLOCK_S)
                    pipe.lpop(self.inbox, INBOX_BATCH)  # what came with it, when the pop returns
                    first, rest = pipe.execute()
                backoff = 0.0
            except redis.RedisError as exc:  # Redis away: the driver's own calls notice and resend
                backoff = min(2.0, max(0.1, backoff * 2))
                logger.warning("draft inbox: Redis error (%s); retrying in %.1fs", exc, backoff)
                self.stopping.wait(backoff)
                continue
            if first:
                arrived_at = time.perf_counter()
                self._arrived.extend((raw, arrived_at) for raw in [first[1], *(rest or [])])
                self.pops += 1
                self.wake.set()

    def pending(self) -> bool:
        """Has anything arrived that the driver has not taken? (no round trip)"""
        return bool(self._arrived)

    def take(self) -> list[tuple[bytes, float]]:
        """Everything arrived so far, in order, each with its arrival time."""
        taken = []
        while self._arrived:
            taken.append(self._arrived.popleft())
        return taken
