"""Redis databases for the tests, handed out by one allocator.

A test module, fixture or stack leases a database of the test Redis (MIRROR_SD_TEST_REDIS, 16 databases):
emptied when leased and when given back, never leased twice at once, so no two live users share one and a
module never sees another's keys. Nothing hard-codes a database number.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import redis

TEST_REDIS = os.environ.get("MIRROR_SD_TEST_REDIS", "redis://127.0.0.1:6379")
NUM_DATABASES = 16


class RedisDatabases:
    def __init__(self, base_url: str = TEST_REDIS, count: int = NUM_DATABASES) -> None:
        self.base_url = base_url.rstrip("/")
        self._free = list(range(count))
        self._lock = threading.Lock()

    def take(self) -> str:
        """A database's URL, emptied; give it back with give_back."""
        with self._lock:
            if not self._free:
                raise RuntimeError(f"all {NUM_DATABASES} test Redis databases are leased: a fixture leaks them")
            db = self._free.pop(0)
        url = f"{self.base_url}/{db}"
        redis.Redis.from_url(url).flushdb()
        return url

    def give_back(self, url: str) -> None:
        redis.Redis.from_url(url).flushdb()
        with self._lock:
            self._free.append(int(url.rsplit("/", 1)[1]))

    @contextmanager
    def lease(self) -> Iterator[str]:
        url = self.take()
        try:
            yield url
        finally:
            self.give_back(url)


DATABASES = RedisDatabases()
