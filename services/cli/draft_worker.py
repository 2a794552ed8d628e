"""`mirror-sd draft-worker`: a Celery worker driving sessions (draft_worker/ is imported only when it runs)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from services.cli.common import apply_env, service_logging

logger = logging.getLogger(__name__)


def draft_worker_command(
    pool: Annotated[str | None, typer.Option(help="pool whose sessions to drive")] = None,
    concurrency: Annotated[int | None, typer.Option(help="sessions driven at once (threads)")] = None,
    worker_id: Annotated[str | None, typer.Option("--worker-id")] = None,
    threads: Annotated[int | None, typer.Option()] = None,
    loglevel: Annotated[str, typer.Option()] = "INFO",
) -> None:
    """Run a Celery draft worker on queue draft.<pool> (thread pool: torch releases the GIL)."""
    apply_env(worker__pool=pool, worker__worker_id=worker_id, num_threads=threads,
               worker__draft_concurrency=concurrency)
    from services.config import get_settings

    settings = get_settings()
    name = settings.worker.worker_id or f"draft-{settings.worker.pool}"
    quiet = []
    if settings.log_format == "json":  # before the imports below, so that even their lines are JSON
        _take_over_celery_logging(name, loglevel)
        quiet = ["--quiet"]  # the start-up banner is printed, not logged
    from draft_worker.tasks import celery_app
    from services.protocol import draft_queue

    celery_app.worker_main([
        *quiet, "worker", "--queues", draft_queue(settings.worker.pool), "--pool", "threads",
        "--concurrency", str(settings.worker.draft_concurrency), "--hostname", f"{name}@%h",
        "--loglevel", loglevel, "--without-mingle", "--without-gossip",
    ])


def _take_over_celery_logging(name: str, loglevel: str) -> None:
    """Celery leaves logging alone when a setup_logging receiver exists: ours, so its lines come out as JSON too."""
    import socket

    from celery.signals import setup_logging

    def configure(**_: object) -> None:
        service_logging("draft-worker", worker_id=f"{name}@{socket.gethostname()}", level=loglevel.upper())

    configure()
    setup_logging.connect(configure, weak=False)
