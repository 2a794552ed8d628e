"""The draft worker process: its loaded drafter, Redis, SQL, the session driver; and one task's session.

A task (one request) takes the request's lease, builds its DraftSession from
the spec and the committed output so far (a redelivered task resumes), hands
it to the process's driver (draft_worker/driver.py) and waits, renewing the
lease; then it records the outcome in SQL (the task stores no Celery result: the gateway sends it with
ignore_result).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache

import redis

from draft_worker.driver import SessionDriver, SessionFailed
from draft_worker.inbox import BLOCK_S
from draft_worker.opening import relay_opening
from services.engine.draft_session import DraftSession
from services import protocol
from services.config import Settings, get_settings
from services.engine.profile import cached_draft_profile
from services.models.drafters import DraftSource
from services.history_feed import follow_history, history_figures
from services.models.drafters.serving import load_serving_draft
from services.protocol import DraftFallback, OutputEvent, SessionSpec, Verdict
from services.link.meter import TRIP_FINISH, TRIP_LEASE, TRIP_OPEN
from services.redis_client import OpenedSession, open_session, read_heartbeats, release_lease, write_heartbeat
from services.redis_conn import connect
from services.speculative.block_length import RecentRounds
from services.speculative.cost_model import CostModel
from services.storage import crud
from services.storage.db import create_db_engine, session_factory

logger = logging.getLogger(__name__)

LEASE_TTL_S = 10
COST_REFRESH_S = 10.0


@dataclass
class DraftRuntime:
    """What a draft worker process loads once and shares across its sessions."""

    settings: Settings
    client: redis.Redis
    draft_source: DraftSource
    worker_id: str
    db: object = None  # sessionmaker for SQL records; None = no records
    profile: dict = field(default_factory=dict)  # measured at start-up: draft_ms_per_token
    fallback: DraftFallback | None = None  # the draft it was given cannot run here; draft_source is the stand-in
    # its sessions open with a target-only round from this many prompt tokens (0: never); in its heartbeat, so
    # gateways send that round themselves (SessionSpec.opened)
    plain_opening_tokens: int = 0
    driver: SessionDriver = field(init=False)
    recent: RecentRounds = field(default_factory=RecentRounds, init=False)
    _costs: dict = field(default_factory=dict, init=False)  # pool -> (read at, CostModel | None)
    _costs_lock: threading.Lock = field(default_factory=threading.Lock, init=False)  # task threads, the heartbeat

    def __post_init__(self) -> None:
        self.driver = SessionDriver(client=self.client, worker_id=self.worker_id,
                                    verdict_timeout_s=self.settings.worker.verdict_timeout_s,
                                    blocks_ahead=self.settings.worker.blocks_ahead,
                                    prefill_after_opening=self.settings.speculative.draft_prefill == "after_opening")
        self.driver.start()
        if self.draft_source.reads_prompt:
            self.plain_opening_tokens = self.settings.speculative.plain_opening_tokens

    @property
    def instance(self) -> str:
        """This process of the worker: what leases and owner keys name (gateway/sessions/recovery.py)."""
        return protocol.instance_id(self.worker_id, os.getpid())

    def close(self) -> None:
        """Stop the driver thread (sessions still running are abandoned; tests and shutdown)."""
        self.driver.stopping.set()
        self.driver.join(timeout=5)
        self.driver.listener.join(timeout=BLOCK_S + 5)  # its blocking pop returns within BLOCK_S (plus the link)

    def cost_model(self, pool: str) -> CostModel | None:
        """For block_policy "cost": the pool's step-cost grid (its verify workers' start-up profiles,
        averaged) and this worker's draft cost. Read once per pool on this path (the first session for it),
        then from the cache, which the heartbeat thread refreshes (refresh_costs): a session's start waits on
        no read of heartbeats, a trip or two over the link."""
        if self.settings.speculative.block_policy != "cost":
            return None
        with self._costs_lock:
            cached = self._costs.get(pool)
        return cached[1] if cached is not None else self._read_costs([pool])[pool]

    def refresh_costs(self) -> None:
        """Re-read the cost models of pools read more than COST_REFRESH_S ago, and of pools that had no verify
        worker's profile yet (the heartbeat thread's, each beat)."""
        now = time.monotonic()
        with self._costs_lock:
            stale = [pool for pool, (read_at, cost) in self._costs.items()
                     if cost is None or now - read_at >= COST_REFRESH_S]
        if stale:
            self._read_costs(stale)

    def _read_costs(self, pools: list[str]) -> dict[str, CostModel | None]:
        beats = read_heartbeats(self.client)
        draft = {key: value for key, value in self.profile.items() if key.startswith("draft_")}
        costs = {}
        for pool in pools:
            curves = [beat.profile for beat in beats if beat.role == "verify" and beat.pool == pool and beat.profile]
            keys = {key for curve in curves for key in curve if key.startswith(("verify_ms_", "step_ms_", "plain_ms_"))}
            merged = {key: sum(curve[key] for curve in curves if key in curve) / sum(key in c for c in curves)
                      for key in keys}
            costs[pool] = CostModel.from_profile({**merged, **draft}, self.profile.get("draft_ms_per_token", 0.0)) \
                if merged else None
        with self._costs_lock:
            self._costs.update({pool: (time.monotonic(), cost) for pool, cost in costs.items()})
        return costs

    def new_session(self, spec: SessionSpec, events: list, opening: Verdict | None = None) -> DraftSession:
        """opening: its round 0's verdict, when that came before the session started (OpenedSession.opening)."""
        cost = self.cost_model(spec.pool)
        if cost is not None:  # this worker's link as measured now: a drafted round pays it unless verified ahead
            cost = dataclasses.replace(cost, link_ms=self.driver.meter.figures().transport_ms_p50 or 0.0,
                                       blocks_ahead=self.driver.blocks_ahead)
        return DraftSession(spec, events, drafter=self.draft_source.new_drafter() if spec.route == "sd" else None,
                            speculative=self.settings.speculative, cost=cost,
                            reply_to=protocol.draft_inbox(self.worker_id),
                            pipelined=self.settings.worker.pipelined_drafting,
                            recent=self.recent, draft_sessions=self.driver.num_sessions + 1,
                            told=opening)


_RUNTIME_LOCK = threading.Lock()
# Connections a draft worker holds beside one per task thread: the driver, its inbox listener and outbox, the
# heartbeat, Celery's own threads; redis-py 8's pool stops at 100 unless told, and 128 task threads each in a
# blocking read (a session's opening relay) ran it out under a burst ("Too many connections").
SPARE_CONNECTIONS = 16


def draft_client(settings: Settings) -> redis.Redis:
    """The draft worker's Redis client: a pool in which every task thread may block on a connection of its own
    at once."""
    return connect(settings.redis_url, max_connections=settings.worker.draft_concurrency + SPARE_CONNECTIONS)


def get_runtime() -> DraftRuntime:
    """Loaded once per worker process (the heartbeat thread and the first tasks ask at the same time: one
    builds it, the others wait; two runtimes would be two drivers on one inbox)."""
    with _RUNTIME_LOCK:
        return _build_runtime()


@lru_cache(maxsize=1)
def _build_runtime() -> DraftRuntime:
    import torch

    settings = get_settings()
    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    worker_id = settings.worker.worker_id or f"draft-{socket.gethostname()}-{os.getpid()}"
    source, vocab_size, fallback = load_serving_draft(settings)
    if fallback is not None and settings.worker.crashed_draft is not None:
        logger.error("%s", fallback.describe())
    profile = cached_draft_profile(source, vocab_size, settings.cache_dir if settings.worker.profile_cache else None)
    logger.info("device profile: %s", profile)
    follow_history(source, settings.redis_url)  # suffix drafts read the fleet's finished outputs
    return DraftRuntime(settings=settings, client=draft_client(settings), draft_source=source,
                        worker_id=worker_id, db=session_factory(create_db_engine(settings.database_url)),
                        profile=profile, fallback=fallback)


def _utc(timestamp: float | None) -> datetime | None:
    return datetime.fromtimestamp(timestamp, timezone.utc) if timestamp else None


def _record(runtime: DraftRuntime, request_id: str, **fields) -> None:
    if runtime.db is None:
        return
    try:
        with runtime.db() as session:
            crud.record_work(session=session, request_id=request_id, **fields)
    except Exception:  # SQL is the record, not the hot path: never fail a session over it
        logger.exception("could not record request %s", request_id)


def _record_ended(runtime: DraftRuntime, request_id: str, last: OutputEvent) -> None:
    """A request found finished when its task opened it: a task that came back after its worker was killed, or
    one that waited on a dead owner's lease, while the verify worker finished the session on its own (bridging).
    Its driver wrote no ending: the row gets it from the stream's last event, unless it has one."""
    if runtime.db is None:
        return
    try:
        with runtime.db() as session:
            crud.close_from_last_event(session=session, request_id=request_id, last=last)
    except Exception:  # SQL is the record, not the hot path
        logger.exception("could not record request %s", request_id)


def _open(runtime: DraftRuntime, request_id: str) -> OpenedSession | None:
    """Become the session's only driver, in one round trip when its lease is free (services/redis_client.py,
    OPEN_SESSION_LUA); wait while a live owner holds it. None: already finished (its row closed if its driver did
    not). The owner key names this worker from then on, for gateways watching for a dead owner."""
    while True:
        opened = open_session(runtime.client, request_id, runtime.instance, LEASE_TTL_S)
        runtime.driver.meter.count_round_trip(TRIP_OPEN)
        if opened.spec is None or opened.leased:
            return opened
        if opened.events and opened.events[-1].finished:
            _record_ended(runtime, request_id, opened.events[-1])
            return None
        time.sleep(0.5)


def drive_session(runtime: DraftRuntime, request_id: str) -> dict:
    client = runtime.client
    opened = _open(runtime, request_id)
    if opened is None:
        return {"request_id": request_id, "finish_reason": "already_finished"}
    if opened.spec is None:
        logger.warning("request %s has no spec (expired or never created)", request_id)
        return {"request_id": request_id, "finish_reason": "error", "error": "no such request"}

    def tick() -> None:  # off the hot path: the driver thread never waits on this
        client.set(protocol.lease_key(request_id), runtime.instance, ex=LEASE_TTL_S)
        runtime.driver.meter.count_round_trip(TRIP_LEASE)

    def started() -> None:  # SQL, after the driver has the session: its first block waits on no record
        _record(runtime, request_id, status="running", started_at=datetime.now(timezone.utc))

    released = False
    try:
        spec, events = SessionSpec.decode(opened.spec), opened.events
        if events and events[-1].finished:
            _record_ended(runtime, request_id, events[-1])
            return {"request_id": request_id, "finish_reason": events[-1].finish_reason}
        session = runtime.new_session(spec, events, opened.opening)
        relay_ended = threading.Event()
        if session.awaits_opening:  # round 0 went from the gateway: its answer comes on the request's own list
            relay_opening(client, request_id, session.reply_to, relay_ended)
        try:
            summary = runtime.driver.drive(session, tick, every_s=LEASE_TTL_S / 4, on_started=started)
        except SessionFailed as exc:
            _record(runtime, request_id, status="failed", error=str(exc), finished_at=datetime.now(timezone.utc),
                    recorded_by=crud.RECORDED_BY_DRIVER)
            raise
        finally:
            relay_ended.set()
        result = summary.to_dict()
        # one trip, after the last verdict: the stream's last event (its output count is the client's completion
        # tokens: the target commits the EOS, and a block's tokens past a stop, which the output leaves out), the
        # lease, and figures for the bench
        with client.pipeline() as pipe:
            pipe.xrevrange(protocol.output_stream(request_id), count=1)
            release_lease(pipe, request_id, runtime.instance)
            for key, samples in ((protocol.TRANSPORT_SAMPLES_KEY, summary.transport_ms),
                                 (protocol.ROUND_TRIP_SAMPLES_KEY, summary.round_trip_ms)):
                if samples:
                    pipe.lpush(key, *(f"{ms:.4f}" for ms in samples))
                    pipe.ltrim(key, 0, protocol.TRANSPORT_SAMPLES_MAX - 1)
            for name, value in summary.timing.as_fields().items():
                pipe.hincrbyfloat(protocol.DRAFT_TIMING_KEY, name, value)
            last = pipe.execute()[0]
        released = True
        output_tokens = OutputEvent.decode(last[0][1][b"m"]).num_output_tokens if last else summary.num_output_tokens
        runtime.driver.meter.count_round_trip(TRIP_FINISH)
        _record(
            runtime,
            request_id,
            status=crud.ended_status(summary.finish_reason),
            finish_reason=summary.finish_reason,
            completion_tokens=output_tokens,
            **summary.stats.row_counters(),
            transport_ms_p50=result["transport_ms_p50"],
            plain_reason=summary.plain_reason,
            first_token_at=_utc(summary.first_token_at),
            finished_at=datetime.now(timezone.utc),
            recorded_by=crud.RECORDED_BY_DRIVER,
        )
        return result
    finally:
        if not released:
            release_lease(client, request_id, runtime.instance)


class DraftHeartbeat(threading.Thread):
    """Tells readiness checks and telemetry that this draft worker process is alive, and how far it is from
    Redis: each beat PINGs first (the smoothed RTT goes into its link figures, with its rounds' round trips)."""

    def __init__(self, runtime_factory: Callable[[], DraftRuntime], pool: str) -> None:
        super().__init__(daemon=True, name="draft-heartbeat")
        self._runtime_factory = runtime_factory
        self._pool = pool
        self.stop = threading.Event()

    def run(self) -> None:
        runtime = self._runtime_factory()
        settings = runtime.settings
        meter = runtime.driver.meter
        while not self.stop.is_set():
            try:
                started = time.perf_counter()
                runtime.client.ping()
                meter.observe_ping(1000 * (time.perf_counter() - started))
                beat = protocol.Heartbeat(worker_id=runtime.worker_id, role="draft", pool=self._pool,
                                          model=runtime.draft_source.spec, profile=runtime.profile,
                                          num_sessions=runtime.driver.num_sessions, pid=os.getpid(),
                                          host=socket.gethostname(), draft_fallback=runtime.fallback,
                                          link=meter.figures(runtime.driver.blocks_ahead),
                                          plain_opening_tokens=runtime.plain_opening_tokens,
                                          suffix_history=history_figures(runtime.draft_source))
                write_heartbeat(runtime.client, beat, settings.worker.heartbeat_ttl_s)
                runtime.refresh_costs()  # here, so that no session's start waits on reading heartbeats
            except redis.RedisError as exc:  # Redis away for a moment: the next beat tries again
                logger.warning("draft heartbeat failed: %s", exc)
            except Exception:
                logger.exception("draft heartbeat failed")
            self.stop.wait(settings.worker.heartbeat_interval_s)
