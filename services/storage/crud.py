"""Keyword-only CRUD over the tables (FastAPI-template style)."""

from __future__ import annotations

import hashlib
import logging
import secrets
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from services.storage.tables import ApiKey, Event, Request, TelemetrySnapshot, utcnow

logger = logging.getLogger(__name__)

PRIORITIES = ("high", "normal", "low")
KEY_PREFIX = "msd-"


def hash_api_key(key: str) -> str:
    # Keys are 256-bit random tokens, so a plain SHA-256 suffices (no password stretching needed).
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(*, session: Session, name: str, priority: str = "normal") -> tuple[ApiKey, str]:
    """Returns the row and the key itself; only its hash is stored, so show it once."""
    if priority not in PRIORITIES:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {priority!r}")
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(name=name, key_hash=hash_api_key(key), key_prefix=key[:10], priority=priority)
    session.add(row)
    session.commit()
    return row, key


def get_api_key(*, session: Session, key: str) -> ApiKey | None:
    row = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_api_key(key)))
    return row if row is not None and row.revoked_at is None else None


def list_api_keys(*, session: Session) -> list[ApiKey]:
    return list(session.scalars(select(ApiKey).order_by(ApiKey.id)))


def revoke_api_key(*, session: Session, key_id: int) -> bool:
    row = session.get(ApiKey, key_id)
    if row is None or row.revoked_at is not None:
        return False
    row.revoked_at = utcnow()
    session.commit()
    return True


def create_request(
    *,
    session: Session,
    request_id: str,
    model: str,
    endpoint: str,
    prompt_tokens: int,
    params: dict[str, Any],
    priority: str,
    route: str,
    pool: str,
    api_key_id: int | None,
) -> Request:
    row = Request(
        id=request_id,
        api_key_id=api_key_id,
        priority=priority,
        model=model,
        endpoint=endpoint,
        prompt_tokens=prompt_tokens,
        params=params,
        status="queued",
        route=route,
        pool=pool,
        queued_at=utcnow(),
        completion_tokens=0,
        num_drafts=0,
        num_draft_tokens=0,
        num_accepted_tokens=0,
    )
    session.add(row)
    session.commit()
    return row


def get_request(*, session: Session, request_id: str) -> Request | None:
    return session.get(Request, request_id)


def update_request(*, session: Session, request_id: str, **fields: Any) -> Request | None:
    row = session.get(Request, request_id)
    if row is None:
        return None
    for name, value in fields.items():
        if not hasattr(Request, name):
            raise ValueError(f"requests has no column {name!r}")
        setattr(row, name, value)
    session.commit()
    return row


CLIENT_ENDED = "cancelled"  # a status its client set (DELETE, or gone before the work started): no worker's undoes it
# who wrote a request's ending (its recorded_by): its session's driver, with the figures only the driver has;
# whoever read the stream's last event first (a gateway, a task that found the request finished), which the
# driver's record replaces if it comes; or its gateway as the client saw it, with no driver's record to come (a
# merged follower, whose work is on its leader's row; a request cancelled while still queued)
RECORDED_BY_DRIVER = "driver"
RECORDED_BY_STREAM = "stream"
RECORDED_BY_CLIENT = "client"


def record_work(*, session: Session, request_id: str, **fields: Any) -> None:
    """A worker's view of a request's generation: its counters always, its status and finish reason unless its
    client cancelled it first (and "running" only over "queued"). The status is checked inside the UPDATE, so a
    cancel landing between a read and a write cannot be lost.
    (In a single flight the leader's client may leave while the generation goes on for the others: its row
    says cancelled, as its client saw it, and carries the generation's work.)"""
    for name in fields:
        if not hasattr(Request, name):
            raise ValueError(f"requests has no column {name!r}")
    held = {name: fields.pop(name) for name in ("status", "finish_reason") if name in fields}
    if fields:
        session.execute(update(Request).where(Request.id == request_id).values(**fields))
    if held:  # its own statement: MySQL evaluates SET left to right, so a CASE on status would see the new one
        # "running" only follows "queued": a row its gateway already closed (the verify worker finished the session
        # before a redelivered task opened it) is not opened again
        allowed = Request.status == "queued" if held.get("status") == "running" else Request.status != CLIENT_ENDED
        session.execute(update(Request).where(Request.id == request_id, allowed).values(**held))
    session.commit()


def ended_status(finish_reason: str | None) -> str:
    """The row status of a request whose output ended with `finish_reason`."""
    return "failed" if finish_reason == "error" else "cancelled" if finish_reason == "cancelled" else "finished"


def close_from_last_event(*, session: Session, request_id: str, last: Any, **fields: Any) -> bool:
    """A request's ending read from its stream's last event (an OutputEvent: its finish reason, output count,
    cumulative stats and error), written only where the row is still open (close_if_open): by whoever saw the
    generation end when its driver did not record it (a task that found the request finished, the gateway that
    read the last event). True: written."""
    reason = last.finish_reason or "stop"
    status = ended_status(reason)
    return close_if_open(session=session, request_id=request_id, status=status, finish_reason=reason,
                         completion_tokens=last.num_output_tokens, **last.stats.row_counters(),
                         error=last.error if status == "failed" else None, finished_at=datetime.now(timezone.utc),
                         recorded_by=RECORDED_BY_STREAM, **fields)


def close_if_open(*, session: Session, request_id: str, **fields: Any) -> bool:
    """A request's ending, written only while its row still says queued or running: the view of a task that found
    the request already finished must not overwrite the record its own driver wrote. True: written."""
    result = session.execute(update(Request).where(Request.id == request_id,
                                                   Request.status.in_(("queued", "running"))).values(**fields))
    session.commit()
    return bool(result.rowcount)


def record_event(
    *,
    session: Session,
    kind: str,
    request_id: str | None = None,
    worker_id: str | None = None,
    detail: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> Event:
    row = Event(kind=kind, request_id=request_id, worker_id=worker_id, detail=detail or {}, created_at=at or utcnow())
    session.add(row)
    session.commit()
    return row


def list_events(*, session: Session, request_id: str | None = None, limit: int = 100) -> list[Event]:
    query = select(Event).order_by(Event.id.desc()).limit(limit)
    if request_id is not None:
        query = query.where(Event.request_id == request_id)
    return list(session.scalars(query))


def record_snapshots(*, session: Session, rows: list[dict[str, Any]]) -> int:
    """One row per worker reading (see TelemetrySnapshot's columns)."""
    session.add_all(TelemetrySnapshot(**row) for row in rows)
    session.commit()
    return len(rows)


def list_snapshots(*, session: Session, worker_id: str | None = None, limit: int = 100) -> list[TelemetrySnapshot]:
    query = select(TelemetrySnapshot).order_by(TelemetrySnapshot.id.desc()).limit(limit)
    if worker_id is not None:
        query = query.where(TelemetrySnapshot.worker_id == worker_id)
    return list(session.scalars(query))
