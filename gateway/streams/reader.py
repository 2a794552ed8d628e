"""Read a request's output stream: its events in order, once each, across Redis outages and failovers.

A stall (no event for STALL_CHECK_S) or a Redis that came back is reported to the reader's `on_stall`
(the caller wires it to gateway/sessions/recovery.py); the reader itself neither submits nor revives."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace

import redis

from gateway.errors import RequestLost
from gateway.state import GatewayState
from gateway.streams.tally import StreamShare
from services.protocol import OutputEvent, output_stream

logger = logging.getLogger(__name__)


class RequestTimeout(Exception):
    pass


@dataclass
class OutputCursor:
    """How many output tokens a reader has taken. An event that repeats some of them (the same round
    committed again after a Redis failover lost the first commit, or a rebuilt session's rounds cut
    otherwise) gives only its new tokens; one that would skip tokens means the stream lost part of itself."""

    num_tokens: int = 0

    def admit(self, event: OutputEvent) -> OutputEvent | None:
        """The event to yield (trimmed to its new tokens), or None for a whole repeat."""
        start = event.num_output_tokens - len(event.token_ids)
        if start > self.num_tokens:
            raise RequestLost(f"request {event.request_id}: its output stream skips tokens {self.num_tokens}.."
                              f"{start - 1} (a Redis failover lost them); retry the request")
        fresh = event.token_ids[self.num_tokens - start:]
        if event.token_ids and not fresh and not event.finished:
            return None
        self.num_tokens = max(self.num_tokens, event.num_output_tokens)
        return event if len(fresh) == len(event.token_ids) else replace(event, token_ids=fresh)


class AnswerCancelled(Exception):
    """A DELETE of this client's request, whose generation goes on for others reading it (single-flight)."""


STALL_CHECK_S = 2.0  # no event for this long: ask whether the session can still finish (on_stall)
REDIS_OUTAGE_S = 30.0  # Redis unreachable for longer: the request ends with an error
RECONNECT_BACKOFF_S = (0.1, 2.0)
READ_WAIT_S = 1.0  # a read returns empty after this long: the stall, cancel and deadline checks run
CANCEL_CHECK_S = 0.25  # how often a reader looks for its own answer's cancellation (the draft driver's is 0.2 s)


StallCheck = Callable[[float], Awaitable[object]]  # seconds without progress -> may raise RequestLost


async def read_output(state: GatewayState, request_id: str, timeout_s: float, *, on_stall: StallCheck | None = None,
                      share: StreamShare | None = None, cancel_key: str | None = None) -> AsyncIterator[OutputEvent]:
    """Yield the request's events in order until the finished one (one XREAD for every stream this gateway reads:
    gateway/streams/shared_reads.py).

    Rides out a Redis outage or failover (reconnecting with backoff, then reading the stream again from its
    start: an OutputCursor yields each token once, however often its round was committed), then asks `on_stall`
    whether the request survived it; raises RequestLost when an outage lasts past REDIS_OUTAGE_S (and lets
    `on_stall`'s RequestLost through). `on_stall` is also asked when no event has come for STALL_CHECK_S.
    With `share`, tokens/s counts only the events no other reader here counted; with `cancel_key`, raises
    AnswerCancelled once that key is set."""
    with state.reads.subscribe(output_stream(request_id)) as subscription:
        async for event in _read(state, request_id, subscription, timeout_s, on_stall, share, cancel_key):
            yield event


async def _read(state: GatewayState, request_id: str, subscription, timeout_s: float, on_stall: StallCheck | None,
                share: StreamShare | None, cancel_key: str | None) -> AsyncIterator[OutputEvent]:
    cursor = OutputCursor()
    deadline = time.monotonic() + timeout_s
    last_progress = checked_at = cancel_checked_at = time.monotonic()
    outage_since: float | None = None
    backoff = RECONNECT_BACKOFF_S[0]
    while True:
        try:
            entries = await subscription.next(READ_WAIT_S)  # gateway/streams/shared_reads.py
            if outage_since is not None and not state.reads.healthy:  # still away: nothing read, no error yet
                continue
            if outage_since is not None:  # Redis is back: did it keep this request?
                logger.info("request %s: Redis is back after %.1fs", request_id, time.monotonic() - outage_since)
                outage_since, backoff = None, RECONNECT_BACKOFF_S[0]
                if on_stall is not None:
                    await on_stall(0.0)
                # A failover's new primary may lack the last events read, and hold them again later under
                # other ids (committed again): read the stream from its start, the cursor skipping repeats.
                subscription.rewind()
                continue
            now = time.monotonic()
            if on_stall is not None and not entries and now - last_progress >= STALL_CHECK_S and \
                    now - checked_at >= STALL_CHECK_S:
                checked_at = now
                await on_stall(now - last_progress)
            if cancel_key is not None and now - cancel_checked_at >= CANCEL_CHECK_S:
                cancel_checked_at = now
                if await state.redis.exists(cancel_key):
                    raise AnswerCancelled(f"request {request_id}: answer cancelled")
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            now = time.monotonic()
            outage_since = outage_since or now
            if now - outage_since > REDIS_OUTAGE_S:
                raise RequestLost(f"the queue (Redis) has been unreachable for {REDIS_OUTAGE_S:.0f}s") from exc
            logger.warning("request %s: Redis unreachable (%s); retrying in %.1fs", request_id, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(RECONNECT_BACKOFF_S[1], backoff * 2)
            continue
        for _, fields in entries:
            event = cursor.admit(OutputEvent.decode(fields[b"m"]))
            if event is None:
                continue
            last_progress = time.monotonic()
            if state.similarity is not None and event.worker_id and \
                    state.similarity.note_worker(request_id, event.worker_id) and state.similarity_log is not None:
                await state.similarity_log.noted(request_id, event.worker_id)
            # tokens/s as they arrive, not when a long request ends; once however many read them
            if state.metrics is not None and (share is None or share.first_sight(event.seq)):
                state.metrics.live.add_tokens(len(event.token_ids))
            yield event
            if event.finished:
                return
        if time.monotonic() > deadline:
            raise RequestTimeout(f"request {request_id} produced no final output within {timeout_s:.0f}s")
