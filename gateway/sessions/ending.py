"""How an answer ends: its session cancelled when nobody reads it any more, its single-flight subscription given
up, a follower's own row closed, a leader's row closed where its draft worker left it open.

A request alone cancels its session when its answer ends early (client gone, timeout, Redis lost it). A
request in a flight (gateway/sessions/single_flight.py) leaves it instead, and only the last subscriber to leave
early cancels the generation; a follower's row is closed by its gateway, since no draft worker drives it."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone

import redis

from gateway.sessions.single_flight import Flight
from gateway.state import GatewayState
from services.protocol import OutputEvent, answer_cancel_key, cancel_key
from services.redis_client import REQUEST_TTL_S
from services.storage import crud

logger = logging.getLogger(__name__)


def _mark_cancelled(state: GatewayState, request_id: str) -> None:
    with state.db() as session:
        row = crud.get_request(session=session, request_id=request_id)
        if row is not None and row.status == "queued":
            crud.update_request(session=session, request_id=request_id, status="cancelled",
                                finish_reason="cancelled", finished_at=datetime.now(timezone.utc),
                                recorded_by=crud.RECORDED_BY_CLIENT)


async def cancel_request(state: GatewayState, request_id: str) -> None:
    """Stop the request's session within a round."""
    await state.redis.set(cancel_key(request_id), b"1", ex=REQUEST_TTL_S)
    await asyncio.to_thread(_mark_cancelled, state, request_id)


async def leave_flight(state: GatewayState, flight: Flight, *, ended: bool) -> int:
    """Out of the flight; the last subscriber out before the end cancels the generation. Returns what
    SingleFlight.leave does (0: this call cancelled it)."""
    left = await state.flights.leave(flight, ended=ended)
    if left == 0:
        logger.info("request %s: last reader of %s's generation gone; cancelling it", flight.request_id,
                    flight.leader_id)
        await cancel_request(state, flight.leader_id)
    return left


async def end_answer(state: GatewayState, flight: Flight | None, request_id: str, *, finished: bool) -> bool:
    """After an answer, however it ended (`finished`: its generation's last event was read, or, for a leader
    that failed to start one, there is none to read); best effort (Redis may be why it ended). True when
    this call cancelled the generation (nobody else reads it)."""
    try:
        if flight is not None:
            return await leave_flight(state, flight, ended=finished) == 0
        if not finished:
            await cancel_request(state, request_id)
            return True
    except (redis.RedisError, OSError) as exc:
        logger.warning("request %s: could not end it cleanly (%s)", request_id, exc)
    return False


async def cancel_answer(state: GatewayState, request_id: str, params: dict) -> None:
    """DELETE /v1/requests/{id}. In a flight: its reader is told to end this client's answer, and the request
    leaves (the last one out cancels the generation), so deleting one never cuts the others. Otherwise
    its session is cancelled."""
    digest = params.get("single_flight")
    if not digest:
        await cancel_request(state, request_id)
        return
    await state.redis.set(answer_cancel_key(request_id), b"1", ex=REQUEST_TTL_S)
    await leave_flight(state, Flight(digest, params.get("merged_into") or request_id, request_id), ended=False)
    await asyncio.to_thread(_mark_cancelled, state, request_id)


def _status(last: OutputEvent | None, finished: bool) -> tuple[str, str]:
    if not finished or last is None:
        return "cancelled", "cancelled"
    return crud.ended_status(last.finish_reason), last.finish_reason or "stop"


async def close_follower_row(state: GatewayState, request_id: str, *, last: OutputEvent | None, finished: bool,
                             num_tokens: int, first_token_at: datetime | None) -> None:
    """A follower's row as its client saw the answer; the work (drafts, acceptance) is on the leader's row."""
    status, finish_reason = _status(last, finished)

    def update() -> None:
        with state.db() as session:
            crud.update_request(session=session, request_id=request_id, status=status, finish_reason=finish_reason,
                                completion_tokens=num_tokens, first_token_at=first_token_at,
                                finished_at=datetime.now(timezone.utc),
                                error=last.error if last is not None and status == "failed" else None,
                                recorded_by=crud.RECORDED_BY_CLIENT)

    try:
        await asyncio.to_thread(update)
    except Exception:  # SQL is the record, not the answer: the client has it already
        logger.exception("could not record request %s", request_id)


async def close_open_row(state: GatewayState, request_id: str, *, last: OutputEvent,
                         first_token_at: datetime | None) -> None:
    """A generation whose last event this gateway read: its row's ending from that event, where the row still
    says queued or running. Its draft worker writes the ending with the work's figures when it drives the
    session to its end; when that worker was killed mid-request, the verify worker finishes the session on its own
    and the row waited for the task's redelivery (the broker's visibility timeout, 300 s), or for ever where a
    Redis restart lost the task: a chaos drill left 28 of 39 rows open. A driver's record written after this one
    overwrites it with its own figures."""
    def close() -> None:
        with state.db() as session:
            crud.close_from_last_event(session=session, request_id=request_id, last=last,
                                       first_token_at=first_token_at)

    try:
        await asyncio.to_thread(close)
    except Exception:  # SQL is the record, not the answer
        logger.exception("could not record request %s", request_id)
