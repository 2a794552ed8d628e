"""Celery tasks of the draft worker: thin wrappers around the session loop."""

from __future__ import annotations

import logging

from celery.signals import worker_ready, worker_shutdown

from draft_worker.runtime import DraftHeartbeat, drive_session, get_runtime
from services.celery_app import create_celery_app
from services.config import get_settings
from services.logs import request_context
from services.protocol import TASK_RUN_SESSION, heartbeat_key

logger = logging.getLogger(__name__)

# The celery CLI needs a module-level app (`celery -A draft_worker.tasks worker`).
celery_app = create_celery_app(get_settings())


@celery_app.task(name=TASK_RUN_SESSION, acks_late=True, reject_on_worker_lost=True)
def run_session(request_id: str) -> dict:
    """Drive one request to its end; safe to run again for the same id (it resumes or returns)."""
    with request_context(request_id):  # this task thread serves one request until it returns
        return drive_session(get_runtime(), request_id)


@worker_ready.connect
def _start_heartbeat(sender=None, **_: object) -> None:
    """Load the drafter before taking work, then heartbeat: readiness means models are loaded."""
    heartbeat = DraftHeartbeat(get_runtime, get_settings().worker.pool)
    heartbeat.start()
    _HEARTBEATS.append(heartbeat)


@worker_shutdown.connect
def _stop_heartbeat(sender=None, **_: object) -> None:
    for heartbeat in _HEARTBEATS:
        heartbeat.stop.set()
        runtime = get_runtime()
        runtime.client.delete(heartbeat_key(runtime.worker_id))


_HEARTBEATS: list[DraftHeartbeat] = []
