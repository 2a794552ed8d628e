"""Every output stream this gateway's answers read, read by one task: one blocking XREAD over all of them.

One XREAD per answer per event made a gateway's cost per token grow with its streams, and each answer held a
pooled connection while it waited. Here an answer subscribes to its request's stream; one task keeps an XREAD
blocked on every stream subscribed, from each subscription's cursor, and hands each one its entries (an answer
then takes them at its own pace: a slow client holds up nobody). A new subscription wakes the blocked XREAD
through a stream of this gateway's own (one XADD), so an answer's first events never wait for the block to end.
A Redis error reaches every subscription (gateway/streams/reader.py rides it out as before); the task retries
with backoff while anyone is subscribed and stops when nobody is.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

import redis
import redis.asyncio as aioredis

logger = logging.getLogger(__name__)

BLOCK_MS = 1000  # the XREAD's block: a subscription's reader gets control back at least this often anyway
COUNT = 256  # entries per stream per XREAD
WAKE_TTL_MS = 60_000
RETRY_S = (0.05, 1.0)


def wake_key(gateway_id: str) -> str:
    return f"mirror-sd:gateway-wake:{gateway_id}"


class Subscription:
    """One answer's view of a stream: the entries after its cursor, in order, or the error the last read met."""

    def __init__(self, reads: "SharedReads", stream: str) -> None:
        self.reads = reads
        self.stream = stream
        self.cursor = "0-0"  # the last entry id handed to this subscription
        self.entries: deque = deque()
        self.error: Exception | None = None
        self.ready = asyncio.Event()

    async def next(self, timeout_s: float) -> list:
        """Entries after the cursor, as [(entry_id, fields)], waiting up to timeout_s ([] after it); raises the
        Redis error the shared read met since the last call."""
        if not self.entries and self.error is None:
            self.ready.clear()
            try:
                await asyncio.wait_for(self.ready.wait(), timeout_s)
            except TimeoutError:
                return []
        if self.error is not None:
            error, self.error = self.error, None
            raise error
        taken = list(self.entries)
        self.entries.clear()
        return taken

    def rewind(self) -> None:
        """Read the stream again from its start (after a failover: its events may be there again under other
        ids); whatever was taken and not yet handed out is dropped."""
        self.entries.clear()
        self.cursor = "0-0"
        self.reads.wake()

    def close(self) -> None:
        self.reads.unsubscribe(self)

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()


class SharedReads:
    def __init__(self, client: aioredis.Redis, gateway_id: str, *, block_ms: int = BLOCK_MS) -> None:
        self.client = client
        self.wake_stream = wake_key(gateway_id)
        self.block_ms = block_ms
        self._subscriptions: set[Subscription] = set()
        self._task: asyncio.Task | None = None
        self._reading = False  # an XREAD is in flight (a new subscription must wake it)
        self._waking: asyncio.Task | None = None
        self._wake_id = "$"
        self.healthy = True  # the last XREAD answered (a subscription's reader knows Redis is back by it)

    def subscribe(self, stream: str) -> Subscription:
        subscription = Subscription(self, stream)
        self._subscriptions.add(subscription)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="shared stream reads")
        else:
            self.wake()
        return subscription

    def close(self) -> None:
        """Stop reading (the gateway is shutting down)."""
        self._subscriptions.clear()
        if self._task is not None:
            self._task.cancel()

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscriptions.discard(subscription)

    def wake(self) -> None:
        """Cut the blocked XREAD short (one XADD to this gateway's wake stream), so it reads the streams again."""
        if self._reading and (self._waking is None or self._waking.done()):
            self._waking = asyncio.get_running_loop().create_task(self._wake())

    async def _wake(self) -> None:
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.xadd(self.wake_stream, {"w": "1"}, maxlen=1, approximate=False)
                pipe.pexpire(self.wake_stream, WAKE_TTL_MS)
                await pipe.execute()
        except redis.RedisError:  # the read meets the same outage and tells the subscriptions
            pass

    async def _run(self) -> None:
        backoff = RETRY_S[0]
        while self._subscriptions:
            cursors: dict[str, str] = {}
            for subscription in self._subscriptions:  # a stream read by two answers: from the earlier cursor
                cursor = cursors.get(subscription.stream)
                cursors[subscription.stream] = subscription.cursor if cursor is None else \
                    min(cursor, subscription.cursor, key=_entry_order)
            cursors[self.wake_stream] = self._wake_id
            self._reading = True
            try:
                response = await self.client.xread(cursors, block=self.block_ms, count=COUNT)
            except Exception as exc:  # noqa: BLE001 - a Redis error (or any other): every subscription hears it
                if not isinstance(exc, (redis.ConnectionError, redis.TimeoutError)):
                    logger.warning("reading %d output streams failed: %s", len(cursors) - 1, exc)
                self._reading = False
                self.healthy = False
                for subscription in self._subscriptions:
                    subscription.error = exc
                    subscription.ready.set()
                await asyncio.sleep(backoff)
                backoff = min(RETRY_S[1], backoff * 2)
                continue
            finally:
                self._reading = False
            backoff, self.healthy = RETRY_S[0], True
            self._deliver(response or [], cursors)

    def _deliver(self, response: list, read_from: dict[str, str]) -> None:
        """The XREAD's entries to each subscription whose cursor the read started at or before (a subscription
        that came, or rewound, while it was in flight gets its entries from the next read: this one may have
        started past them)."""
        by_stream: dict[str, list] = {}
        for stream, entries in response:
            name = stream.decode() if isinstance(stream, bytes) else stream
            if name == self.wake_stream:
                self._wake_id = _text(entries[-1][0])
                continue
            by_stream[name] = entries
        for subscription in self._subscriptions:
            entries = by_stream.get(subscription.stream)
            start = read_from.get(subscription.stream)
            order = _entry_order(subscription.cursor)
            if not entries or start is None or _entry_order(start) > order:
                continue
            fresh = [(entry_id, fields) for entry_id, fields in entries if _entry_order(_text(entry_id)) > order]
            if fresh:
                subscription.entries.extend(fresh)
                subscription.cursor = _text(fresh[-1][0])
                subscription.ready.set()


def _text(entry_id) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def _entry_order(entry_id: str) -> tuple[int, int]:
    milliseconds, _, sequence = entry_id.partition("-")
    return int(milliseconds), int(sequence or 0)
