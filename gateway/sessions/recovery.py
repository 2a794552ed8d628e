"""A stalled stream: find out whether its session can still finish, and revive it when it can.

The gateway holds the client's connection, so it is the part that notices a
request stop moving. When no event has come for a while it asks, in order:
- is the request's state still in Redis? A Redis that restarted without
  persistence lost it: the request ends with an error the client can retry;
- did a worker take the session (the owner key: a draft worker, or the verify
  worker that drafts for it, placement local) and is that worker's heartbeat
  gone? Then it died mid-session (kill -9, OOM, a lost host): start the
  session again, as it was started (a Celery task, or a start block on its
  verify pool's queue). The new driver reads the committed output and resumes
  from there, so the client's stream neither repeats nor skips a token. One
  gateway re-sends per dead owner (a SET NX guard);
- never started, for 30 s, while workers have room? Its task (or start
  block) died with a worker that had just taken it off the queue: send it
  again.
Celery's own redelivery of the unacknowledged task (acks_late) comes later,
after the broker's visibility timeout, and finds the session finished.
"""

from __future__ import annotations

import logging

from gateway.errors import RequestLost
from gateway.state import GatewayState
from gateway.sessions.submit import start
from gateway.fleet.workers import live_workers
from services import protocol
from services.redis_client import release_lease

logger = logging.getLogger(__name__)

UNSTARTED_RESEND_S = 30.0


async def owner_alive(redis, instance: str) -> bool:
    """The owner's worker heartbeats, from the same process (a restarted worker keeps its id, not its pid)."""
    worker_id, pid = protocol.parse_instance(instance)
    raw = await redis.get(protocol.heartbeat_key(worker_id))
    if raw is None:
        return False
    try:
        beat = protocol.Heartbeat.decode(raw)
    except protocol.ProtocolError:
        return True  # cannot tell: do not revive on a doubt
    return not pid or not beat.pid or beat.pid == pid


async def _resend_unstarted(state: GatewayState, spec: protocol.SessionSpec, stalled_s: float) -> bool:
    """A task a draft worker had taken off the queue but not yet started when it was killed is gone (kombu
    moves a message to its unacknowledged index in a second step), and so is a start block a verify worker
    had just popped. Unstarted for UNSTARTED_RESEND_S while its workers have room means it is not waiting its
    turn: send it again. Were it only slow, the extra start finds the session held (or its lease taken) and
    then finished."""
    if stalled_s < UNSTARTED_RESEND_S:
        return False
    beats = await live_workers(state)
    if spec.draft_placement == "local":
        room = any(b.role == "verify" and b.pool == spec.pool for b in beats)
    else:
        limit = state.settings.worker.draft_concurrency
        room = any(b.role == "draft" and b.pool == state.settings.worker.pool and b.num_sessions < limit
                   for b in beats)
    if not room:
        return False  # no worker with room (all busy, or one restarting): it is waiting its turn
    if not await state.redis.set(protocol.revive_key(spec.request_id, "unstarted"), b"1", nx=True,
                                 ex=int(UNSTARTED_RESEND_S)):
        return False
    await _resend(state, spec, f"not started after {stalled_s:.0f}s while its workers have room")
    return True


async def check_stalled(state: GatewayState, request_id: str, priority: int, stalled_s: float = 0.0) -> bool:
    """Raises RequestLost when the session cannot finish; True when this call re-sent its task."""
    redis = state.redis
    raw_spec = await redis.get(protocol.request_key(request_id))
    if raw_spec is None:
        raise RequestLost(f"request {request_id} was lost by the queue (Redis restarted without its data); "
                          "retry the request")
    spec = protocol.SessionSpec.decode(raw_spec)
    owner = await redis.get(protocol.owner_key(request_id))
    if owner is None:  # not started: queued behind others, or its task died with a worker before it started
        return await _resend_unstarted(state, spec, stalled_s)
    owner_id = owner.decode()
    if await owner_alive(redis, owner_id):
        return False
    if not await redis.set(protocol.revive_key(request_id, owner_id), b"1", nx=True, ex=600):
        return False  # another gateway (or an earlier check) already re-sent it
    await release_lease(redis, request_id, owner_id)  # the dead owner's (else the new task waits out its TTL)
    role = "verify worker" if spec.draft_placement == "local" else "draft worker"
    await _resend(state, spec, f"{role} {owner_id} is gone")
    return True


async def _resend(state: GatewayState, spec: protocol.SessionSpec, why: str) -> None:
    await start(state, spec, revive=True)
    logger.warning("request %s: %s; re-sent the session, it resumes from its output", spec.request_id, why)
    if state.metrics is not None:
        state.metrics.revived.inc()
