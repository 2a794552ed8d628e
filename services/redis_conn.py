"""Redis clients for every process: a single server or the primary a Sentinel set names (services/redis_url.py).

Light on purpose (redis-py and the URL parser only, no torch): container health checks use it too,
`python -m services.redis_conn has-key KEY`.
"""

from __future__ import annotations

import sys

import redis
import redis.asyncio as aioredis
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.sentinel import Sentinel

from services.redis_url import SentinelTarget, is_sentinel, parse_sentinel_url

# Sentinels answer at once or not at all: a dead one must not hold up finding the primary.
SENTINEL_TIMEOUT_S = 0.5


def _sentinel_kwargs(target: SentinelTarget) -> dict:
    kwargs: dict = {"socket_timeout": SENTINEL_TIMEOUT_S, "socket_connect_timeout": SENTINEL_TIMEOUT_S}
    if target.sentinel_password:
        kwargs["password"] = target.sentinel_password
    return kwargs


def _primary_kwargs(target: SentinelTarget, options: dict) -> dict:
    auth = {"username": target.username, "password": target.password}
    return {"db": target.db, **{k: v for k, v in auth.items() if v}, **options}


def _sentinels(target: SentinelTarget) -> Sentinel:
    return Sentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target))


def connect(url: str, **options) -> redis.Redis:
    """A bytes-in, bytes-out client (msgpack payloads). With a `redis+sentinel://` URL its connections go to
    whichever server the sentinels name primary now: after a failover the next command that fails on the
    old one (ConnectionError, or READONLY from a demoted one) is retried by the caller on the new one."""
    options = {"socket_keepalive": True, "health_check_interval": 30, **options}
    if not is_sentinel(url):
        return redis.Redis.from_url(url, **options)
    target = parse_sentinel_url(url)
    return _sentinels(target).master_for(target.master, **_primary_kwargs(target, options))


class _BlockingSentinelPool(AsyncSentinelPool, aioredis.BlockingConnectionPool):
    """The sentinel-managed pool that waits for a free connection instead of failing (the gateway's)."""


def connect_async(url: str, *, max_connections: int | None = None, pool_timeout_s: float | None = None,
                  **options) -> aioredis.Redis:
    """connect()'s asyncio twin; with `max_connections` a blocking pool: a burst waits up to `pool_timeout_s`
    for a connection instead of failing."""
    options = {"socket_keepalive": True, "health_check_interval": 30, **options}
    if max_connections is not None:
        options.update(max_connections=max_connections, timeout=pool_timeout_s)
    if not is_sentinel(url):
        if max_connections is None:
            return aioredis.Redis.from_url(url, **options)
        return aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(url, **options))
    target = parse_sentinel_url(url)
    manager = AsyncSentinel(list(target.sentinels), sentinel_kwargs=_sentinel_kwargs(target))
    pool_class = _BlockingSentinelPool if max_connections is not None else AsyncSentinelPool
    return manager.master_for(target.master, connection_pool_class=pool_class,
                              **_primary_kwargs(target, options))


def primary_address(url: str) -> str:
    """Where commands go now: host:port of the server (the sentinels' current answer for a Sentinel URL)."""
    if not is_sentinel(url):
        kwargs = redis.connection.parse_url(url)
        return kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    target = parse_sentinel_url(url)
    host, port = _sentinels(target).discover_master(target.master)
    return f"{host}:{port}"


def describe_redis(url: str) -> str:
    """One line for operators: where the primary is now and how it was found (never a password)."""
    try:
        primary = primary_address(url)
    except (redis.RedisError, OSError) as exc:
        primary = f"unknown ({type(exc).__name__}: {exc})"
    if not is_sentinel(url):
        return f"primary {primary}"
    return f"primary {primary} ({parse_sentinel_url(url).describe()})"


def is_reachable(url: str, timeout_s: float = 0.5) -> bool:
    try:
        return bool(connect(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                            socket_keepalive=False, health_check_interval=0).ping())
    except (redis.ConnectionError, redis.TimeoutError, OSError, ValueError):
        return False


def main(argv: list[str]) -> int:
    """`has-key KEY`: 0 when Redis at MIRROR_SD_REDIS_URL holds KEY (a container's health), else 1."""
    import os

    if len(argv) != 2 or argv[0] != "has-key":
        print("usage: python -m services.redis_conn has-key KEY", file=sys.stderr)
        return 2
    try:
        return 0 if connect(os.environ["MIRROR_SD_REDIS_URL"], socket_timeout=3).exists(argv[1]) else 1
    except (redis.RedisError, OSError, KeyError, ValueError) as exc:
        print(f"unhealthy: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
