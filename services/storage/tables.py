"""Tables. Change them only together with a migration in migrations/versions/."""

from __future__ import annotations

from datetime import datetime, timezone

from sqlalchemy import JSON, DateTime, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class Base(DeclarativeBase):
    pass


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True, index=True)  # sha256 hex
    key_prefix: Mapped[str] = mapped_column(String(16))  # shown in listings, never the key
    priority: Mapped[str] = mapped_column(String(16), default="normal")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Request(Base):
    __tablename__ = "requests"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[int | None] = mapped_column(ForeignKey("api_keys.id"), nullable=True, index=True)
    priority: Mapped[str] = mapped_column(String(16), default="normal")
    model: Mapped[str] = mapped_column(String(256))
    endpoint: Mapped[str] = mapped_column(String(64))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    params: Mapped[dict] = mapped_column(JSON, default=dict)
    status: Mapped[str] = mapped_column(String(16), default="queued", index=True)
    route: Mapped[str] = mapped_column(String(32), default="sd")
    pool: Mapped[str] = mapped_column(String(32), default="cpu")
    queued_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    first_token_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    finish_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    num_drafts: Mapped[int] = mapped_column(Integer, default=0)
    num_draft_tokens: Mapped[int] = mapped_column(Integer, default=0)
    num_accepted_tokens: Mapped[int] = mapped_column(Integer, default=0)
    transport_ms_p50: Mapped[float | None] = mapped_column(Float, nullable=True)
    # why its draft went target-only for a while: cost (no block pays for itself), link (one would, but not with
    # the remote draft's link), acceptance (too low, no cost model); None: it never did
    plain_reason: Mapped[str | None] = mapped_column(String(16), nullable=True)
    # who wrote the ending (crud.RECORDED_BY_*): the session's driver, with the figures only it has (e.g. its
    # transport); whoever read the stream's last event first (the driver's record follows, or never where the
    # driver died); or the gateway as its client saw it (a merged follower, a cancel while queued); None: no ending
    recorded_by: Mapped[str | None] = mapped_column(String(16), nullable=True)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)


class Event(Base):
    __tablename__ = "events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    kind: Mapped[str] = mapped_column(String(64), index=True)
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True, index=True)
    worker_id: Mapped[str | None] = mapped_column(String(128), nullable=True)
    detail: Mapped[dict] = mapped_column(JSON, default=dict)


class TelemetrySnapshot(Base):
    __tablename__ = "telemetry_snapshots"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, index=True)
    worker_id: Mapped[str] = mapped_column(String(128), index=True)
    role: Mapped[str] = mapped_column(String(16))
    pool: Mapped[str] = mapped_column(String(32))
    device_kind: Mapped[str] = mapped_column(String(16))
    utilization: Mapped[float] = mapped_column(Float)
    temperature_c: Mapped[float | None] = mapped_column(Float, nullable=True)
    acceptance_rate: Mapped[float | None] = mapped_column(Float, nullable=True)
    latency_p99_ms: Mapped[float | None] = mapped_column(Float, nullable=True)
    num_sessions: Mapped[int] = mapped_column(Integer)
    queue_depth: Mapped[int] = mapped_column(Integer)
    routing_version: Mapped[int] = mapped_column(Integer)
