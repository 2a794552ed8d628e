"""`mirror-sd verify-worker`: load the target once, heartbeat, serve blocks until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading

import redis

from services.config import Settings
from services.protocol import heartbeat_key
from services.models.loading import load_model
from services.models.precision import lossless_warning
from services.redis_conn import connect
from services.engine.profile import cached_draft_profile, cached_verify_profile
from services.engine.wide_steps import WIDE_MIN_TOKENS, cached_wide_steps, plain_step_costs, wide_min_tokens
from services.history_feed import follow_history
from services.models.drafters.serving import load_serving_draft
from services.models.engine import TorchEngine
from services.speculative.cost_model import CostModel
from services.storage.db import create_db_engine, session_factory
from verify_worker.local_drafts import LocalDrafting
from verify_worker.records import Recorder
from verify_worker.worker import VerifyWorker

logger = logging.getLogger(__name__)


def default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}"


def _heartbeat_loop(worker: VerifyWorker, stop: threading.Event, interval_s: float, ttl_s: float) -> None:
    while not stop.is_set():
        try:
            worker.heartbeat(ttl_s)
        except redis.RedisError as exc:  # Redis blips must not kill the heartbeat thread
            logger.warning("heartbeat failed: %s", exc)
        except Exception:
            logger.exception("heartbeat failed")
        stop.wait(interval_s)


def _plain_steps(settings: Settings, engine) -> tuple[int, dict[str, float]]:
    """The fewest tokens of a step on worker.wide_threads while no speculative session is held, from one-token
    steps timed here at both thread counts (services/engine/wide_steps.py), and what such target-only steps cost
    ("plain_ms_<rows>", for remote drafts' cost models: their plain arm); WIDE_MIN_TOKENS and none without wide
    threads or with co-located drafting."""
    import torch

    wide = settings.worker.wide_threads
    if not wide or wide == torch.get_num_threads() or settings.worker.draft_placement == "local":
        return WIDE_MIN_TOKENS, {}
    timings = cached_wide_steps(engine, settings.cache_dir if settings.worker.profile_cache else None,
                                threads=torch.get_num_threads(), wide=wide, max_rows=settings.scheduler.max_batch_size)
    fewest = wide_min_tokens(timings)
    logger.info("plain steps of %d+ tokens run on %d threads (one-token steps, ms: %s)", fewest,
                wide, timings or "not measured alone")
    return fewest, plain_step_costs(timings, fewest)


def local_drafting(settings: Settings, target, verify_profile: dict) -> LocalDrafting:
    """The draft this worker drafts its own sessions with (placement local), on the same threads as the target
    (they take turns), and the cost model its sessions choose block lengths by: its own step grid and its
    draft's cost, not pipelined."""
    source, vocab_size, fallback = load_serving_draft(settings, target=target)
    draft_profile = cached_draft_profile(source, vocab_size,
                                         settings.cache_dir if settings.worker.profile_cache else None)
    logger.info("drafting for its own sessions with %s: %s", source.spec, draft_profile)
    follow_history(source, settings.redis_url)  # suffix drafts read the fleet's finished outputs
    cost = None
    if settings.speculative.block_policy == "cost":
        cost = CostModel.from_profile({**verify_profile, **draft_profile}, pipelined=False)
    return LocalDrafting(source, settings.speculative, cost=cost, fallback=fallback, draft_profile=draft_profile)


def run_verify_worker(settings: Settings, worker_id: str | None = None) -> None:
    import torch

    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    worker_id = worker_id or settings.worker.worker_id or default_worker_id("verify")
    target = load_model(settings.target, precision=settings.target_precision, device=settings.device,
                        cache_dir=settings.cache_dir)
    if (warning := lossless_warning(settings.target_precision)) is not None:
        logger.warning(warning)
    client = connect(settings.redis_url)
    engine = TorchEngine(target, budget_bytes=settings.worker.kv_budget_mb * 1024 * 1024)
    profile = cached_verify_profile(engine, settings.cache_dir if settings.worker.profile_cache else None,
                                    max_rows=settings.scheduler.max_batch_size)
    logger.info("device profile: %s", profile)
    local = local_drafting(settings, target, profile) if settings.worker.draft_placement == "local" else None
    plain_wide_min_tokens, plain_steps = _plain_steps(settings, engine)
    recorder = Recorder(session_factory(create_db_engine(settings.database_url))) if local is not None else None
    if recorder is not None:
        recorder.start()
    worker = VerifyWorker(
        client=client,
        engine=engine,
        worker_id=worker_id,
        pool=settings.worker.pool,
        scheduler=settings.scheduler,
        merging=settings.merging,
        device=settings.device,
        device_kind=settings.worker.device_kind,
        profile={**profile, **plain_steps, **(local.draft_profile if local is not None else {})},
        local=local,
        recorder=recorder,
        wide_threads=settings.worker.wide_threads,
        plain_wide_min_tokens=plain_wide_min_tokens,
        draft_after_opening=settings.speculative.draft_prefill == "after_opening",
        load_word=settings.worker.load_word,
    )
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    beat = threading.Thread(
        target=_heartbeat_loop,
        args=(worker, stop, settings.worker.heartbeat_interval_s, settings.worker.heartbeat_ttl_s),
        daemon=True,
    )
    beat.start()
    try:
        worker.serve(stop)
    finally:
        stop.set()
        # the threads end before the interpreter does: the heartbeat's last write, the SQL records still queued
        beat.join(timeout=settings.worker.heartbeat_interval_s + 5)
        if recorder is not None:
            recorder.close()
            recorder.join(timeout=10)
        client.delete(heartbeat_key(worker_id))
        logger.info("verify worker %s stopped", worker_id)
