"""A value read from Redis and kept for a short time, refreshed by one read however many requests want it at
once (a burst that finds it stale waits on the same read instead of sending one each)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Cached(Generic[T]):
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._value: T | None = None
        self._expires = 0.0
        self._refresh: asyncio.Future | None = None

    async def get(self, load: Callable[[], Awaitable[T]], *, fresh: bool = False) -> T:
        if not fresh and time.monotonic() < self._expires:
            return self._value
        if self._refresh is None or self._refresh.done():
            self._refresh = asyncio.ensure_future(self._load(load))
        return await asyncio.shield(self._refresh)  # one waiter giving up does not cancel the others' read

    async def _load(self, load: Callable[[], Awaitable[T]]) -> T:
        value = await load()
        self._value, self._expires = value, time.monotonic() + self.ttl_s
        return value

    def clear(self) -> None:
        self._expires = 0.0
