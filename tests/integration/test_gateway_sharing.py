"""What several gateways share through Redis, two gateways' parts on one real Redis. Admission
(gateway/admission/shared.py): one limit between them, per tier and per key; a gateway that stops beating
(killed) has its slots dropped when its lease runs out; a lost Redis is never an exception other than a
refusal. Similarity routing (gateway/fleet/similarity_log.py): a prompt started on one is found on the other."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from gateway.admission.slots import Rejected
from gateway.admission.shared import FULL_HINT_S, SharedAdmission
from services.protocol import GATEWAYS_KEY
from tests.redis_dbs import DATABASES


@pytest.fixture
def redis_url():
    with DATABASES.lease() as url:
        yield url


def gateways(client, count: int = 2, **limits) -> list[SharedAdmission]:
    return [SharedAdmission(**{"max_inflight": 2, **limits}, redis=client, gateway_id=f"gw-{index}")
            for index in range(count)]


async def refused(admission: SharedAdmission, tier: str = "high", key: object = None) -> Rejected:
    with pytest.raises(Rejected) as caught:
        await admission.acquire(tier, key)
    return caught.value


async def settle(admission: SharedAdmission) -> None:
    """Let the give-backs scheduled by release reach Redis."""
    while admission._tasks:
        await asyncio.gather(*list(admission._tasks))


def test_two_gateways_hold_one_limit_between_them(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        a, b = gateways(client)
        first = await a.acquire("high")
        await b.acquire("high")
        full = await refused(b)  # b holds 1 of its own: only the shared count says it is full
        a.release(first)
        await settle(a)
        await asyncio.sleep(FULL_HINT_S)  # b takes "full" for an answer this long
        again = await b.acquire("high")
        await a.beat()
        total = a.total_inflight
        await client.aclose()
        return full, again, total

    full, again, total = asyncio.run(scenario())
    assert full.status_code == 503 and full.retry_after_s >= 1 and "capacity" in full.message
    assert again is not None and total == 2


def count_claims(admission: SharedAdmission) -> list:
    """A list that grows by one each time `admission` asks Redis for a slot."""
    asked = []
    claim = admission._claim_script

    async def counted(**kwargs):
        asked.append(1)
        return await claim(**kwargs)

    admission._claim_script = counted
    return asked


def test_a_full_answer_is_kept_briefly_so_a_bursts_refusals_skip_redis(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        a, b = gateways(client)
        await a.acquire("high")
        await a.acquire("high")
        asked = count_claims(b)
        burst = [await refused(b) for _ in range(50)]
        early = b.refusal("high")  # what the layer in front of the routes asks, before reading a body
        after_burst = len(asked)
        await asyncio.sleep(FULL_HINT_S)
        await refused(b)
        await client.aclose()
        return burst, early, after_burst, len(asked)

    burst, early, after_burst, after_hint = asyncio.run(scenario())
    assert all(r.status_code == 503 for r in burst) and early is not None and early.status_code == 503
    assert after_burst == 1 and after_hint == 2  # one question for the burst, one once the hint ran out


def test_claims_on_their_way_count_so_a_burst_asks_redis_at_most_the_limit(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        (a,) = gateways(client, count=1)
        asked = count_claims(a)
        outcomes = await asyncio.gather(*(a.acquire("high") for _ in range(20)), return_exceptions=True)
        await client.aclose()
        return outcomes, len(asked)

    outcomes, asked = asyncio.run(scenario())
    taken = [o for o in outcomes if not isinstance(o, Rejected)]
    assert len(taken) == 2 and all(o.status_code == 503 for o in outcomes if isinstance(o, Rejected))
    assert asked == 2  # the other 18 were refused on the two claims under way, without a round trip


def test_tier_shares_and_per_key_limits_hold_across_gateways(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        a, b = gateways(client, max_inflight=4, max_inflight_per_key=2)
        await a.acquire("low", key=7)
        await b.acquire("low", key=8)
        await a.acquire("low", key=8)  # 3 of 4: low's 75% is full
        low = await refused(b, "low", key=9)
        over_key = await refused(b, "high", key=8)  # 2 in flight for key 8, one on each gateway
        high = await b.acquire("high", key=9)
        await client.aclose()
        return low, over_key, high

    low, over_key, high = asyncio.run(scenario())
    assert low.status_code == 503 and over_key.status_code == 429 and high is not None


def test_a_gateway_that_stops_beating_has_its_slots_dropped_when_its_lease_runs_out(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        killed, alive = gateways(client, lease_s=0.3)
        await killed.acquire("high")
        await killed.acquire("high")  # then nothing more from it: a kill -9
        first = await refused(alive)
        deadline = time.monotonic() + 30
        while True:
            try:
                ticket = await alive.acquire("high")
                break
            except Rejected:
                assert time.monotonic() < deadline, "the dead gateway's slots were never dropped"
                await asyncio.sleep(0.05)
        members = [m.decode() for m in await client.zrange(GATEWAYS_KEY, 0, -1)]
        await client.aclose()
        return first, ticket, members

    first, ticket, members = asyncio.run(scenario())
    assert first.status_code == 503 and ticket is not None and members == ["gw-1"]


def test_a_beat_puts_back_slots_a_restarted_redis_lost(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        a, b = gateways(client)
        await a.acquire("high")
        await a.acquire("high")
        await client.flushdb()  # what a Redis restart without its data does
        await b.acquire("high")  # admitted: nothing in Redis says a holds two
        await a.beat()
        over = await refused(b)
        await client.aclose()
        return over

    assert asyncio.run(scenario()).status_code == 503


def test_a_waiter_on_one_gateway_is_granted_a_slot_freed_on_the_other(redis_url):
    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        a, b = gateways(client, max_inflight=1, queue_limit=2, queue_timeout_s=30)
        held = await a.acquire("normal")
        waiter = asyncio.create_task(b.acquire("normal"))
        while b.queued == 0:
            await asyncio.sleep(0.01)
        a.release(held)
        ticket = await waiter
        await client.aclose()
        return ticket, b

    ticket, b = asyncio.run(scenario())
    assert ticket is not None and b.queued == 0 and b.inflight == 1


def test_without_redis_a_gateway_admits_its_share_and_refuses_the_rest():
    async def scenario():
        client = aioredis.Redis.from_url("redis://127.0.0.1:9/0", socket_connect_timeout=0.2)  # nothing there
        (alone,) = gateways(client, count=1)
        alone.live_gateways = 2  # as its last beat saw: its share is half of max_inflight 2
        ticket = await alone.acquire("high")
        over = await refused(alone)
        alone.release(ticket)
        await settle(alone)
        await alone.beat()  # fails quietly
        await client.aclose()
        return ticket, over, alone

    ticket, over, alone = asyncio.run(scenario())
    assert ticket is not None and over.status_code == 503 and alone.inflight == 0


def test_a_prompt_started_on_one_gateway_is_found_similar_on_the_other(redis_url):
    from gateway.fleet.similarity import SimilarityIndex
    from gateway.fleet.similarity_log import SimilarityLog
    from services.config import MergingSettings

    prompt = list(range(100, 160))

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        a, b = (SimilarityLog(client, SimilarityIndex(MergingSettings()), f"gw-{index}") for index in range(2))
        sketch = a.index.sketch(prompt)
        a.index.add("cmpl-a", sketch, "salt")
        await a.added("cmpl-a", sketch, "salt")
        if a.index.note_worker("cmpl-a", "verify-cpu-0"):
            await a.noted("cmpl-a", "verify-cpu-0")
        follower = asyncio.create_task(b.follow())
        query = b.index.sketch(prompt[:-1] + [7])
        deadline = time.monotonic() + 30
        while not b.index.most_similar(query, salt="salt"):
            assert time.monotonic() < deadline, "the other gateway never learned of the prompt"
            await asyncio.sleep(0.01)
        follower.cancel()
        found = b.index.most_similar(query, salt="salt")
        await client.aclose()
        return found, b.index.most_similar(query, salt=None)

    found, other_salt = asyncio.run(scenario())
    assert [(item.request_id, item.worker_id) for item in found] == [("cmpl-a", "verify-cpu-0")]
    assert other_salt == []


def test_a_generation_read_on_two_gateways_has_its_stats_counted_by_one(redis_url):
    from gateway.streams.tally import claim_across_gateways

    async def scenario():
        client = aioredis.Redis.from_url(redis_url)
        claims = [await claim_across_gateways(client, "cmpl-a") for _ in range(2)]
        await client.aclose()
        return claims

    assert asyncio.run(scenario()) == [True, False]
