"""gateway/fleet/cache.py: a burst that finds the value stale shares one read."""

import asyncio

from gateway.fleet.cache import Cached


def test_a_stale_value_is_read_once_for_everyone_waiting():
    reads = []

    async def load():
        reads.append(1)
        await asyncio.sleep(0.01)
        return len(reads)

    async def run():
        cache = Cached(ttl_s=60)
        first = await asyncio.gather(*(cache.get(load) for _ in range(50)))
        again = await cache.get(load)
        fresh = await cache.get(load, fresh=True)
        return first, again, fresh

    first, again, fresh = asyncio.run(run())
    assert first == [1] * 50 and again == 1  # one read for the burst, then the cached value
    assert fresh == 2 and len(reads) == 2


def test_a_waiter_that_gives_up_does_not_cancel_the_read():
    async def run():
        cache = Cached(ttl_s=60)
        started = asyncio.Event()

        async def load():
            started.set()
            await asyncio.sleep(0.05)
            return "value"

        quitter = asyncio.ensure_future(cache.get(load))
        await started.wait()
        quitter.cancel()
        return await cache.get(load)

    assert asyncio.run(run()) == "value"
