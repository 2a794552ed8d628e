"""Admission control: in-flight slots per priority tier, a bounded wait queue, per-key limits.

A request takes a slot before any other work (tokenization, SQL, Redis), so a
burst is answered at the cost of a counter check. Each tier may fill its share
of `max_inflight` (high 100%, normal 90%, low 75% by default): the last slots
are kept for higher tiers. A full tier answers 503 with Retry-After at once;
with `queue_limit` > 0 up to that many requests may instead wait for a slot,
for at most `queue_timeout_s`, higher tiers served first (a wait that runs
out is a 503 too, and a slow one: keep it short where refusals must be quick). A key with more
than `max_inflight_per_key` requests in flight gets 429: it is over its own
limit, not the server.

Single event loop: no locks; every method runs between awaits.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass, field

TIERS = ("high", "normal", "low")  # service order when a slot frees
_GRANTED, _DRAINING = "granted", "draining"


class Rejected(Exception):
    def __init__(self, status_code: int, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.retry_after_s = retry_after_s


def tier_limit(max_inflight: int, share: float) -> int:
    """Slots a tier may fill: its share of the total, at least one."""
    return max(1, math.floor(max_inflight * share + 1e-9))


@dataclass
class Ticket:
    tier: str
    key: object  # the API key id (None with auth off: no per-key limit applies)
    released: bool = False
    id: str | None = None  # shared admission: its field in this gateway's slots in Redis


@dataclass
class Admission:
    max_inflight: int
    queue_limit: int = 0
    queue_timeout_s: float = 1.0
    tier_share: dict[str, float] = field(default_factory=lambda: {"high": 1.0, "normal": 0.9, "low": 0.75})
    max_inflight_per_key: int = 0  # 0: no per-key limit
    retry_after_s: int = 2
    draining: bool = False
    inflight: int = 0
    per_key: dict[object, int] = field(default_factory=dict)
    waiting: dict[str, deque] = field(default_factory=lambda: {tier: deque() for tier in TIERS})

    def limit(self, tier: str) -> int:
        return tier_limit(self.max_inflight, self.tier_share.get(tier, 1.0))

    @property
    def queued(self) -> int:
        return sum(len(queue) for queue in self.waiting.values())

    def _has_room(self, tier: str) -> bool:
        return self.inflight < self.limit(tier)

    def _reject(self, message: str) -> Rejected:
        return Rejected(503, message, self.retry_after_s)

    def _key_over_limit(self) -> Rejected:
        return Rejected(429, f"this API key already has {self.max_inflight_per_key} requests in flight "
                        "(gateway.max_inflight_per_key); retry when one finishes", self.retry_after_s)

    def _free_now(self, tier: str) -> bool:
        ahead = TIERS[:TIERS.index(tier) + 1] if tier in TIERS else TIERS  # this tier and those above it
        return self._has_room(tier) and not any(self.waiting.get(t) for t in ahead)

    def refusal(self, tier: str, key: object = None) -> Rejected | None:
        """What acquire would refuse at once (draining, the key over its limit, the tier full with no wait
        allowed), or None; changes nothing. The gateway asks this before it reads a request's body."""
        if self.draining:
            return self._reject("server is shutting down; retry on another replica or shortly")
        if key is not None and self.max_inflight_per_key and self.per_key.get(key, 0) >= self.max_inflight_per_key:
            return self._key_over_limit()
        if not self._free_now(tier) and (self.queued >= self.queue_limit or self.queue_timeout_s <= 0):
            return self._reject("server is at capacity; retry shortly")
        return None

    async def acquire(self, tier: str, key: object = None) -> Ticket:
        """A slot for one request, or Rejected (503 full or draining, 429 key over its limit)."""
        refused = self.refusal(tier, key)
        if refused is not None:
            raise refused
        ticket = Ticket(tier, key)
        if self._free_now(tier):
            self._take(ticket)
            return ticket
        return await self._wait(ticket)

    async def _wait(self, ticket: Ticket) -> Ticket:
        """In the queue until a slot is granted (_grant), the wait runs out or the gateway drains."""
        tier = ticket.tier
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(tier, deque()).append((future, ticket))
        try:
            outcome = await asyncio.wait_for(asyncio.shield(future), self.queue_timeout_s)
        except (asyncio.TimeoutError, asyncio.CancelledError) as exc:
            if future.done() and not future.cancelled() and future.result() == _GRANTED:
                self.release(ticket)  # granted just as the wait ended: give it back
            else:
                future.cancel()
                self._forget(tier, future)
            if isinstance(exc, asyncio.CancelledError):  # the client went away: not ours to answer
                raise
            raise self._reject("server is at capacity; retry shortly") from None
        if outcome != _GRANTED:
            raise self._reject("server is shutting down; retry on another replica or shortly")
        return ticket

    def _take(self, ticket: Ticket) -> None:
        self.inflight += 1
        if ticket.key is not None:
            self.per_key[ticket.key] = self.per_key.get(ticket.key, 0) + 1

    def _forget(self, tier: str, future: asyncio.Future) -> None:
        queue = self.waiting.get(tier, deque())
        for item in list(queue):
            if item[0] is future:
                queue.remove(item)

    def release(self, ticket: Ticket) -> None:
        """Give a slot back (idempotent), then grant waiting requests in tier order while room allows."""
        if ticket.released:
            return
        ticket.released = True
        self.inflight -= 1
        if ticket.key is not None:
            left = self.per_key.get(ticket.key, 1) - 1
            if left > 0:
                self.per_key[ticket.key] = left
            else:
                self.per_key.pop(ticket.key, None)
        self._grant()

    def _grant(self) -> None:
        for tier in TIERS:
            queue = self.waiting.get(tier, deque())
            while queue and self._has_room(tier):
                future, ticket = queue.popleft()
                if future.done():
                    continue
                self._take(ticket)
                future.set_result(_GRANTED)
            if queue:  # this tier still waits: lower tiers must not pass it
                return

    def drain(self) -> None:
        """Refuse new requests; waiting ones are answered 503 now."""
        self.draining = True
        for queue in self.waiting.values():
            while queue:
                future, _ = queue.popleft()
                if not future.done():
                    future.set_result(_DRAINING)
