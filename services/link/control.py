"""A running link, told what to add and telling what it does, through the Redis it forwards to.

The link writes its LinkStatus under `link_status_key(name)` every second
(expiring when it stops) and applies the LinkSetting under
`link_setting_key(name)`, which it writes itself at start (its command
line wins over a stale one) and anyone may change later: `set_link` and
`wait_link` are what the bench calls between its `--draft-link` levels.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import redis

from services.link.proxy import LinkProxy
from services.link.spec import LinkSpec
from services.protocol import (
    LINK_STATUS_TTL_S,
    LinkSetting,
    LinkStatus,
    ProtocolError,
    link_setting_key,
    link_status_key,
)
from services.redis_conn import connect_async

logger = logging.getLogger(__name__)

CONTROL_EVERY_S = 0.5


def status_of(proxy: LinkProxy, name: str) -> LinkStatus:
    counters = proxy.counters
    return LinkStatus(name=name, listen=f"{proxy.host}:{proxy.port}",
                      upstream=f"{proxy.upstream_host}:{proxy.upstream_port}", rtt_ms=proxy.spec.rtt_ms,
                      jitter_ms=proxy.spec.jitter_ms, connections=counters.connections,
                      bytes_up=counters.bytes_up, bytes_down=counters.bytes_down, pid=os.getpid())


async def control(proxy: LinkProxy, redis_url: str, name: str, stop: asyncio.Event) -> None:
    """Apply the setting in Redis and publish the status, every CONTROL_EVERY_S, until `stop`; a Redis that
    is away is waited for (the link forwards meanwhile, or fails to, as the Redis behind it does)."""
    client = connect_async(redis_url, socket_timeout=2, socket_connect_timeout=2)
    announced = False
    try:
        while not stop.is_set():
            try:
                if not announced:  # our command line's setting, over whatever an earlier run left there
                    await client.set(link_setting_key(name), LinkSetting(
                        rtt_ms=proxy.spec.rtt_ms, jitter_ms=proxy.spec.jitter_ms, set_by="link").encode())
                    announced = True
                raw = await client.get(link_setting_key(name))
                if raw is not None:
                    setting = LinkSetting.decode(raw)
                    proxy.apply(LinkSpec(setting.rtt_ms, setting.jitter_ms))
                await client.set(link_status_key(name), status_of(proxy, name).encode(),
                                 px=LINK_STATUS_TTL_S * 1000)
            except (redis.RedisError, OSError) as exc:
                logger.warning("link %s: Redis control failed (%s); retrying", name, exc)
            except (ProtocolError, ValueError) as exc:
                logger.warning("link %s: ignoring a bad setting: %s", name, exc)
            try:
                await asyncio.wait_for(stop.wait(), CONTROL_EVERY_S)
            except asyncio.TimeoutError:
                pass
        await client.delete(link_status_key(name))
    except (redis.RedisError, OSError):
        pass
    finally:
        await client.aclose()


async def serve(proxy: LinkProxy, *, redis_url: str | None, name: str, ready=None) -> None:
    """Run the link until SIGINT or SIGTERM; redis_url None: no control through Redis. `ready(proxy)` is
    called once it listens."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await proxy.start()
    if ready is not None:
        ready(proxy)
    try:
        if redis_url is not None:
            await control(proxy, redis_url, name, stop)
        else:
            await stop.wait()
    finally:
        await proxy.close()


# --- from other processes (sync) -------------------------------------------------------------------
def read_link(client: redis.Redis, name: str) -> LinkStatus | None:
    raw = client.get(link_status_key(name))
    if raw is None:
        return None
    try:
        return LinkStatus.decode(raw)
    except ProtocolError as exc:
        logger.warning("ignoring a bad link status: %s", exc)
        return None


def set_link(client: redis.Redis, name: str, spec: LinkSpec, set_by: str) -> None:
    client.set(link_setting_key(name), LinkSetting(rtt_ms=spec.rtt_ms, jitter_ms=spec.jitter_ms,
                                                   set_by=set_by).encode())


def wait_link(client: redis.Redis, name: str, spec: LinkSpec, timeout_s: float = 10.0) -> LinkStatus:
    """Until the running link says it applies `spec`; RuntimeError when it does not in time (or none runs)."""
    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        status = read_link(client, name)
        if status is not None and (status.rtt_ms, status.jitter_ms) == (spec.rtt_ms, spec.jitter_ms):
            return status
        time.sleep(0.1)
    seen = f"it still adds RTT {status.rtt_ms:g} ms" if status else "no link of that name runs"
    raise RuntimeError(f"link {name!r} did not apply {spec.describe()} within {timeout_s:.0f}s ({seen})")
