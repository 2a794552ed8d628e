"""Single-flight: identical requests in flight at once share one generation.

A request whose tokens follow from its parameters alone (greedy, or sampled with a seed) has a flight key:
a digest of everything that changes those tokens. The first request with a key *leads*: it creates the
session as any request does. Requests with the same key that come while it runs *follow*: no session, no
task; they read the leader's output stream (every reader gets it whole, from its first event) and format
it for their own client. This is not a result cache: the first reader to see the generation end deletes
the key, so a later identical request starts afresh.

One Redis hash per key holds the leader and one field per subscriber. Join and leave are Lua scripts, so
they are atomic across gateways; a subscriber is a field, not a count, so leaving twice (a DELETE, then
the reader's own end) is harmless. Only the last subscriber to leave before the end cancels the
generation: one client leaving never cuts the others. The hash expires with the request's other keys
(REQUEST_TTL_S), so a crashed gateway leaves nothing forever.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.schemas import SamplingFields
from services import protocol
from services.protocol import SessionSpec
from services.redis_client import REQUEST_TTL_S

logger = logging.getLogger(__name__)

# Returns the leader's request id: the one already there, else the caller's.
_JOIN_LUA = """
local leader = redis.call('HGET', KEYS[1], 'leader')
if not leader then
  leader = ARGV[1]
  redis.call('HSET', KEYS[1], 'leader', leader)
end
redis.call('HSET', KEYS[1], 'member:' .. ARGV[1], '1')
redis.call('EXPIRE', KEYS[1], ARGV[2])
return leader
"""

# ARGV: the flight's leader, the leaving request, '1' when the generation is over (or never started).
# Returns the subscribers left (0: the caller was the last and cancels the generation); -1 when there is
# nothing to decide: the hash is another flight's or gone, the caller had left already, or it is over.
_LEAVE_LUA = """
if redis.call('HGET', KEYS[1], 'leader') ~= ARGV[1] then return -1 end
if ARGV[3] == '1' then
  redis.call('DEL', KEYS[1])
  return -1
end
if redis.call('HDEL', KEYS[1], 'member:' .. ARGV[2]) == 0 then return -1 end
local left = redis.call('HLEN', KEYS[1]) - 1
if left <= 0 then redis.call('DEL', KEYS[1]) end
return left
"""

SPEC_WAIT_S = 10.0  # a follower waits this long for its leader's spec, then ends the flight and joins again
SPEC_POLL_S = 0.02


def flight_key(*, model: str, prompt_ids: list[int], max_new_tokens: int, params: SamplingFields,
               priority: str) -> str | None:
    """The digest identical requests share; None when the output is not a function of the request (sampled
    without a seed). Greedy output ignores top_p, top_k and seed, so they are left out of its key; the
    priority tier is in it, so a high-priority request never waits on a low-priority generation; the
    requested route too, since seeded samples differ between plain and speculative rounds and a client
    asking for "ar" asks for that generation; the cache salt, so requests only share within one; penalties and
    biases, the output's grammar, and how many log probabilities (a generation computes only those its leader
    asked for). Not in it:
    streaming and the endpoint's formatting."""
    sampling = params.sampling()
    if sampling.greedy:
        knobs: dict[str, object] = {"greedy": True}
    elif sampling.seed is not None:
        knobs = {"temperature": float(sampling.temperature), "top_p": float(sampling.top_p),
                 "top_k": int(sampling.top_k), "seed": int(sampling.seed)}
    else:
        return None
    if sampling.processes_logits:  # penalties and biases change greedy output too
        knobs.update(presence=float(sampling.presence_penalty), frequency=float(sampling.frequency_penalty),
                     repetition=float(sampling.repetition_penalty), bias=[list(p) for p in sampling.logit_bias])
    fields = {"model": model, "prompt_ids": [int(t) for t in prompt_ids], "max_new_tokens": int(max_new_tokens),
              "stop": list(params.stop), "ignore_eos": bool(params.ignore_eos), "route": params.route or "sd",
              "priority": priority, "cache_salt": params.cache_salt, "logprobs": sampling.logprobs,
              "grammar": sampling.grammar, **knobs}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class Flight:
    """One subscriber's view of a flight."""

    key: str  # the digest
    leader_id: str  # the request whose session generates; its output stream is read
    request_id: str  # this subscriber's own request (response id, SQL row)

    @property
    def leading(self) -> bool:
        return self.leader_id == self.request_id

    @property
    def merged_into(self) -> str | None:
        return None if self.leading else self.leader_id


class SingleFlight:
    """The flight scripts, bound to the gateway's Redis client."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self._join = redis.register_script(_JOIN_LUA)
        self._leave = redis.register_script(_LEAVE_LUA)

    async def join(self, key: str, request_id: str) -> Flight:
        leader = await self._join(keys=[protocol.flight_key(key)], args=[request_id, REQUEST_TTL_S])
        return Flight(key, leader.decode() if isinstance(leader, bytes) else str(leader), request_id)

    async def leave(self, flight: Flight, *, ended: bool) -> int:
        """`ended`: the generation is over (its last event was read) or never started (the leader failed):
        the flight is deleted whoever is still in it. Else this subscriber leaves early. Returns the
        subscribers left: 0 means the caller was the last and must cancel the generation; -1 nothing to do."""
        left = await self._leave(keys=[protocol.flight_key(flight.key)],
                                 args=[flight.leader_id, flight.request_id, "1" if ended else "0"])
        return int(left)

    async def leader_spec(self, flight: Flight, wait_s: float = SPEC_WAIT_S) -> SessionSpec | None:
        """The leader's spec once it is written (the leader joins before it validates its route and writes
        it); None when the leader gave up, or wrote nothing within wait_s (a gateway that died in between:
        the flight is ended so nobody else waits on it). On None the caller joins again."""
        deadline = time.monotonic() + wait_s
        while True:
            raw = await self.redis.get(protocol.request_key(flight.leader_id))
            if raw is not None:
                return SessionSpec.decode(raw)
            leader = await self.redis.hget(protocol.flight_key(flight.key), "leader")
            if leader is None or leader.decode() != flight.leader_id:
                return None
            if time.monotonic() > deadline:
                logger.warning("flight %s: leader %s wrote no spec within %.0fs; ending the flight", flight.key,
                               flight.leader_id, wait_s)
                await self.leave(flight, ended=True)
                return None
            await asyncio.sleep(SPEC_POLL_S)
