"""Redis databases for the tests, handed out by one allocator.

A test module, fixture or stack leases a database of the test Redis (MIRROR_SD_TEST_REDIS): emptied when
leased and when given back, never leased twice at once, so no two live users share one and a module never
sees another's keys. Leases are kept in the test Redis itself (in its last database, never handed out),
so two test runs on one Redis (a developer's and CI's) do not meet either; a lease whose process is gone
(a run killed with -9) is taken over. Nothing hard-codes a database number.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import redis

TEST_REDIS = os.environ.get("MIRROR_SD_TEST_REDIS", "redis://127.0.0.1:6379")
NUM_DATABASES = 16
REGISTRY_DB = NUM_DATABASES - 1  # where the leases are kept
LEASE_TTL_S = 3 * 3600  # a lease nobody gives back (a lost host) ends after this
LEASE_PREFIX = "mirror-sd:test:lease:"


def _holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def _gone(holder: bytes) -> bool:
    """The holder is a process of this host that no longer runs."""
    host, _, pid = holder.decode().rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class RedisDatabases:
    def __init__(self, base_url: str = TEST_REDIS) -> None:
        self.base_url = base_url.rstrip("/")
        self.registry = redis.Redis.from_url(f"{self.base_url}/{REGISTRY_DB}")

    def take(self) -> str:
        """A database's URL, emptied; give it back with give_back."""
        for db in range(REGISTRY_DB):
            key = f"{LEASE_PREFIX}{db}"
            if not self.registry.set(key, _holder(), nx=True, ex=LEASE_TTL_S):
                holder = self.registry.get(key)
                if holder is None or not _gone(holder):
                    continue
                self.registry.set(key, _holder(), ex=LEASE_TTL_S)  # its process is gone: ours now
            url = f"{self.base_url}/{db}"
            redis.Redis.from_url(url).flushdb()
            return url
        raise RuntimeError(f"all {REGISTRY_DB} test Redis databases are leased (see {LEASE_PREFIX}* in database "
                           f"{REGISTRY_DB}): a fixture leaks them, or too many test runs share this Redis")

    def give_back(self, url: str) -> None:
        redis.Redis.from_url(url).flushdb()
        self.registry.delete(f"{LEASE_PREFIX}{url.rsplit('/', 1)[1]}")

    @contextmanager
    def lease(self) -> Iterator[str]:
        url = self.take()
        try:
            yield url
        finally:
            self.give_back(url)


DATABASES = RedisDatabases()
