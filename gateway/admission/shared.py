"""Admission counted in Redis, so that several gateways (behind one port, or one load balancer) hold one
`max_inflight`, one share per tier and one per-key limit between them (`gateway.shared_admission`, which
`mirror-sd gateway --workers N` and `mirror-sd up --gateways N` turn on).

Each gateway holds its slots as fields of its own hash (`admission:<gateway id>`: ticket -> API key id) and a
lease in one sorted set (`gateways`: id -> expiry, on Redis's clock). Taking a slot is one Lua script: drop the
gateways whose lease ran out, with their slots (a gateway killed with -9 frees its slots within
`admission_lease_s`), count the live gateways' slots (and the key's), and add the ticket only under the limits.
Giving one back deletes its field, so giving back twice is harmless. A beat every lease/5 renews the lease and
rewrites the hash from what the gateway holds: a give-back lost in a Redis outage, or slots a restarted Redis
lost, are right again within a beat.

Per gateway still: the quick refusals on its own counts (its slots are part of the total, so what it refuses
alone is refused), its wait queue (up to `queue_limit` in each gateway, granted in tier order there; the head
tries again every POLL_S, since a slot may free on another gateway), and draining. Redis unreachable: a gateway
admits on its own, with its share of the limits (the limit over the gateways alive at its last beat), so an
outage is never a 500 and the total stays near the limit; its next beat puts its slots in Redis again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import time
from dataclasses import dataclass, field

import redis

from gateway.admission.slots import _GRANTED, TIERS, Admission, Rejected, Ticket
from services.protocol import ADMISSION_SLOTS_PREFIX, GATEWAYS_KEY, admission_slots_key

logger = logging.getLogger(__name__)

POLL_S = 0.02  # a waiting head asks again this often: slots freed on other gateways tell it nothing
# After Redis answers "full" for a tier, the tier counts as full here for this long (unless a slot frees on
# this gateway): a burst's refusals then cost a counter check, as with one gateway, not a Redis round trip
# each. A slot freed on another gateway meanwhile is seen at most this late (the refused got Retry-After).
FULL_HINT_S = 0.05
CLAIM_TIMEOUT_S = 1.0  # longer, and Redis is taken for away: the gateway admits on its own
OUTAGE_LOG_S = 10.0

# Drops expired gateways, with their slots. KEYS[1]: the gateways set. ARGV[1]: the slots' key prefix.
# Leaves `now` (ms, Redis's clock) for the rest of the script.
_PRUNE_LUA = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
for _, dead in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('DEL', ARGV[1] .. dead)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
"""

# KEYS[2]: this gateway's slots. ARGV: prefix, gateway id, lease ms, ticket, API key id ('': none), the tier's
# limit, the per-key limit (0: none). Returns 0 taken, 1 full (503), 2 the key over its limit (429).
_CLAIM_LUA = _PRUNE_LUA + """
if not redis.call('ZSCORE', KEYS[1], ARGV[2]) then  -- Redis lost us (restarted): in again
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
end
local key, key_limit = ARGV[5], tonumber(ARGV[7])
local total, of_key = 0, 0
for _, gateway in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  local slots = ARGV[1] .. gateway
  total = total + redis.call('HLEN', slots)
  if key ~= '' and key_limit > 0 then
    for _, holder in ipairs(redis.call('HVALS', slots)) do
      if holder == key then of_key = of_key + 1 end
    end
  end
end
if key ~= '' and key_limit > 0 and of_key >= key_limit then return 2 end
if total >= tonumber(ARGV[6]) then return 1 end
redis.call('HSET', KEYS[2], ARGV[4], key)
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return 0
"""

# ARGV: prefix, gateway id, lease ms, then ticket, API key id pairs: what the gateway holds. Returns the live
# gateways and the slots they hold.
_BEAT_LUA = _PRUNE_LUA + """
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[2])
redis.call('DEL', KEYS[2])
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1])
end
redis.call('PEXPIRE', KEYS[2], ARGV[3])
local total = 0
for _, gateway in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  total = total + redis.call('HLEN', ARGV[1] .. gateway)
end
return {redis.call('ZCARD', KEYS[1]), total}
"""

_TAKEN, _FULL, _KEY_FULL = 0, 1, 2
_REDIS_DOWN = (redis.RedisError, OSError, asyncio.TimeoutError)


@dataclass
class SharedAdmission(Admission):
    redis: object = None  # the gateway's asyncio Redis client
    gateway_id: str = ""
    lease_s: float = 10.0
    live_gateways: int = 1  # at the last beat: the outage share's divisor
    total_inflight: int = 0  # every live gateway's slots, at the last beat
    held: dict[str, Ticket] = field(default_factory=dict)  # ticket id -> ticket with a slot here
    pending: dict[str, Ticket] = field(default_factory=dict)  # claims on their way to Redis
    _ids: itertools.count = field(default_factory=itertools.count)
    _tasks: set = field(default_factory=set)
    _granting: asyncio.Task | None = None
    _outage_logged: float = 0.0
    _full_until: dict[str, float] = field(default_factory=dict)  # tier -> monotonic time (FULL_HINT_S)

    def __post_init__(self) -> None:
        self._claim_script = self.redis.register_script(_CLAIM_LUA)
        self._beat_script = self.redis.register_script(_BEAT_LUA)

    @property
    def _keys(self) -> list[str]:
        return [GATEWAYS_KEY, admission_slots_key(self.gateway_id)]

    @property
    def _lease_ms(self) -> int:
        return int(self.lease_s * 1000)

    def _has_room(self, tier: str) -> bool:
        """Room on what this gateway knows: its slots and its claims on their way to Redis (either may be
        a slot of the total), and no recent "full" from Redis. A burst's requests beyond the limit are then
        refused here at once, in front of the routes, instead of each asking Redis."""
        return self.inflight + len(self.pending) < self.limit(tier) and \
            time.monotonic() >= self._full_until.get(tier, 0.0)

    async def acquire(self, tier: str, key: object = None) -> Ticket:
        refused = self.refusal(tier, key)  # on this gateway's own counts (part of the total) and hints
        if refused is not None:
            raise refused
        ticket = Ticket(tier, key)
        if self._free_now(tier):
            refused = await self._claim(ticket)
            if refused is None:
                return ticket
            if refused.status_code == 429 or self.queued >= self.queue_limit or self.queue_timeout_s <= 0:
                raise refused
        self._spawn(self._grant_waiting())
        return await self._wait(ticket)

    async def _claim(self, ticket: Ticket) -> Rejected | None:
        """The slot taken in Redis (None), or why not; alone, on this gateway's share, while Redis is away."""
        ticket.id = str(next(self._ids))
        self.pending[ticket.id] = ticket
        try:
            outcome = await asyncio.wait_for(self._claim_script(keys=self._keys, args=[
                ADMISSION_SLOTS_PREFIX, self.gateway_id, self._lease_ms, ticket.id, _holder(ticket.key),
                self.limit(ticket.tier), self.max_inflight_per_key]), CLAIM_TIMEOUT_S)
        except _REDIS_DOWN as exc:
            self._outage(exc)
            outcome = self._alone(ticket)
        except asyncio.CancelledError:  # the client left; the script may have run
            self._spawn(self._give_back(ticket.id))
            raise
        finally:
            self.pending.pop(ticket.id, None)
        if int(outcome) == _TAKEN:
            self._take(ticket)
            return None
        if int(outcome) == _KEY_FULL:
            return self._key_over_limit()
        self._full_until[ticket.tier] = time.monotonic() + FULL_HINT_S
        return self._reject("server is at capacity; retry shortly")

    def _alone(self, ticket: Ticket) -> int:
        """Redis away: this gateway's share of the limits, on its own counts."""
        share = max(1, self.live_gateways)
        if ticket.key is not None and self.max_inflight_per_key and \
                self.per_key.get(ticket.key, 0) >= math.ceil(self.max_inflight_per_key / share):
            return _KEY_FULL
        return _TAKEN if self.inflight < math.ceil(self.limit(ticket.tier) / share) else _FULL

    def _take(self, ticket: Ticket) -> None:
        super()._take(ticket)
        self.held[ticket.id] = ticket

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        super().release(ticket)
        self._full_until.clear()  # a slot is free again, here at least
        self.held.pop(ticket.id, None)
        self._spawn(self._give_back(ticket.id))

    def _grant(self) -> None:
        """Waiters are granted by _grant_waiting, once the slot is back in Redis (_give_back)."""

    async def _give_back(self, ticket_id: str | None) -> None:
        if ticket_id is not None:
            try:
                await self.redis.hdel(admission_slots_key(self.gateway_id), ticket_id)
            except _REDIS_DOWN as exc:  # the next beat rewrites the slots without it
                self._outage(exc)
        await self._grant_waiting()

    async def _grant_waiting(self) -> None:
        """Grant the waiters in tier order, then arrival order, while Redis has room; one pass at a time."""
        if self._granting is not None and not self._granting.done():
            return
        self._granting = asyncio.current_task()
        while not self.draining:
            head = self._head()
            if head is None:
                return
            future, ticket = head
            if await self._claim(ticket) is not None:
                await asyncio.sleep(POLL_S)
                continue
            self._forget(ticket.tier, future)
            if future.done():  # its wait ran out meanwhile
                self.release(ticket)
            else:
                future.set_result(_GRANTED)

    def _head(self) -> tuple[asyncio.Future, Ticket] | None:
        for tier in TIERS:
            for future, ticket in self.waiting.get(tier, ()):
                if not future.done():
                    return future, ticket
        return None

    async def keep_lease(self) -> None:
        """The gateway's beat, for as long as it serves (a task of its lifespan)."""
        while True:
            await self.beat()
            await asyncio.sleep(self.lease_s / 5)

    async def beat(self) -> None:
        tickets = {**self.held, **self.pending}  # a claim under way may be taken: counted, never missed
        pairs = [value for ticket_id, ticket in tickets.items() for value in (ticket_id, _holder(ticket.key))]
        try:
            live, total = await self._beat_script(keys=self._keys, args=[
                ADMISSION_SLOTS_PREFIX, self.gateway_id, self._lease_ms, *pairs])
        except _REDIS_DOWN as exc:
            self._outage(exc)
            return
        self.live_gateways, self.total_inflight = int(live), int(total)

    async def leave(self) -> None:
        """Out of the count at shutdown (best effort: else the lease runs out)."""
        try:
            await self.redis.zrem(GATEWAYS_KEY, self.gateway_id)
            await self.redis.delete(admission_slots_key(self.gateway_id))
        except _REDIS_DOWN as exc:
            logger.warning("gateway %s: could not leave the shared admission count: %s", self.gateway_id, exc)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)  # held, or the loop may collect it half-way
        task.add_done_callback(self._tasks.discard)

    def _outage(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._outage_logged >= OUTAGE_LOG_S:
            self._outage_logged = now
            logger.warning("shared admission: Redis unreachable (%s: %s); admitting on this gateway's share "
                           "(1/%d of the limits)", type(exc).__name__, exc, max(1, self.live_gateways))


def _holder(key: object) -> str:
    return "" if key is None else str(key)
