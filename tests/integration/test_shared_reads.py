"""One XREAD for every output stream a gateway reads (gateway/streams/shared_reads.py), on a real Redis: each
subscription gets every entry of its stream once and in order, from the start, however late it came and whoever
else reads the stream; a new subscription wakes the blocked read; a rewind reads again from the start; a Redis
that is away reaches every subscription as its error; the read stops when nobody is subscribed."""

from __future__ import annotations

import asyncio

import pytest
import redis
import redis.asyncio as aioredis

from gateway.streams.shared_reads import SharedReads

LONG_BLOCK_MS = 20_000  # a read that is not woken holds on this long: far past what any check below waits


async def drain(subscription, count: int, timeout_s: float = 5.0) -> list[bytes]:
    got: list[bytes] = []
    async with asyncio.timeout(timeout_s):
        while len(got) < count:
            got.extend(fields[b"m"] for _, fields in await subscription.next(1.0))
    return got


def test_every_subscription_gets_its_streams_entries_once_in_order_from_the_start(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        reads = SharedReads(client, "gw-test", block_ms=LONG_BLOCK_MS)
        for index in range(3):
            await client.xadd("s:a", {"m": f"a{index}"})
        early = reads.subscribe("s:a")
        other = reads.subscribe("s:b")
        first = await drain(early, 3)
        for index in range(3, 6):
            await client.xadd("s:a", {"m": f"a{index}"})
        late = reads.subscribe("s:a")  # comes while the shared read is blocked past a0..a5's start
        await client.xadd("s:b", {"m": "b0"})
        result = first + await drain(early, 3), await drain(late, 6), await drain(other, 1)
        for subscription in (early, late, other):
            subscription.close()
        await client.aclose()
        return result

    early, late, other = asyncio.run(scenario())
    assert early == late == [f"a{index}".encode() for index in range(6)]
    assert other == [b"b0"]


def test_a_rewound_subscription_reads_its_stream_again_from_the_start(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        reads = SharedReads(client, "gw-test", block_ms=LONG_BLOCK_MS)
        await client.xadd("s:a", {"m": "x"})
        await client.xadd("s:a", {"m": "y"})
        with reads.subscribe("s:a") as subscription:
            first = await drain(subscription, 2)
            subscription.rewind()
            again = await drain(subscription, 2)
        await client.aclose()
        return first, again

    first, again = asyncio.run(scenario())
    assert first == again == [b"x", b"y"]


def test_the_shared_read_stops_when_nobody_is_subscribed_and_starts_again_for_the_next(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        reads = SharedReads(client, "gw-test", block_ms=200)
        with reads.subscribe("s:a"):
            task = reads._task
        await asyncio.wait_for(task, 2.0)  # ended within a block of the last one leaving
        await client.xadd("s:a", {"m": "z"})
        with reads.subscribe("s:a") as subscription:
            got = await drain(subscription, 1)
            restarted = reads._task is not task
        await client.aclose()
        return got, restarted

    got, restarted = asyncio.run(scenario())
    assert got == [b"z"] and restarted


def test_a_redis_that_is_away_reaches_every_subscription_as_its_error():
    async def scenario():
        client = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2)  # nothing listens there
        reads = SharedReads(client, "gw-test")
        errors = []
        subscriptions = [reads.subscribe("s:a"), reads.subscribe("s:b")]
        for subscription in subscriptions:
            with pytest.raises(redis.ConnectionError) as raised:
                async with asyncio.timeout(5.0):
                    while True:
                        await subscription.next(1.0)
            errors.append(raised.value)
        healthy = reads.healthy
        for subscription in subscriptions:
            subscription.close()
        await client.aclose()
        return errors, healthy

    errors, healthy = asyncio.run(scenario())
    assert len(errors) == 2 and not healthy
