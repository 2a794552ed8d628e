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
from services.redis_client import connect
from services.engine.profile import cached_verify_profile
from services.models.engine import TorchEngine
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


def run_verify_worker(settings: Settings, worker_id: str | None = None) -> None:
    import torch

    if settings.num_threads:
        torch.set_num_threads(settings.num_threads)
    worker_id = worker_id or settings.worker.worker_id or default_worker_id("verify")
    target = load_model(settings.target, precision=settings.target_precision, device=settings.device,
                        cache_dir=settings.cache_dir)
    client = connect(settings.redis_url)
    engine = TorchEngine(target, budget_bytes=settings.worker.kv_budget_mb * 1024 * 1024)
    profile = cached_verify_profile(engine, settings.cache_dir if settings.worker.profile_cache else None,
                                    max_rows=settings.scheduler.max_batch_size)
    logger.info("device profile: %s", profile)
    worker = VerifyWorker(
        client=client,
        engine=engine,
        worker_id=worker_id,
        pool=settings.worker.pool,
        scheduler=settings.scheduler,
        merging=settings.merging,
        device=settings.device,
        device_kind=settings.worker.device_kind,
        profile=profile,
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
        client.delete(heartbeat_key(worker_id))
        logger.info("verify worker %s stopped", worker_id)
