"""`mirror-sd verify-worker`: the target model's process (verify_worker/ is imported only when it runs)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from services.cli.common import apply_env, fail, setup
from services.errors import MirrorSDError

logger = logging.getLogger(__name__)


def verify_worker_command(
    pool: Annotated[str | None, typer.Option(help="pool to serve (default settings.worker.pool)")] = None,
    worker_id: Annotated[str | None, typer.Option("--worker-id")] = None,
    threads: Annotated[int | None, typer.Option()] = None,
    wide_threads: Annotated[int | None, typer.Option(
        "--wide-threads", min=1, help="threads for a step while no draft worker drafts for this worker's sessions "
        "(default settings.worker.wide_threads: --threads always)")] = None,
    device_kind: Annotated[str | None, typer.Option(
        "--device-kind", help="report this device kind in heartbeats, e.g. accelerator (drills on a CPU box)")] = None,
    draft_placement: Annotated[str | None, typer.Option(
        "--draft-placement", help="remote: draft workers draft its sessions; local: it drafts for its own sessions "
        "in-process with --draft (default settings.worker.draft_placement)")] = None,
    draft: Annotated[str | None, typer.Option(help="draft spec for --draft-placement local (default: settings)")] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False,
) -> None:
    """Run a verify worker: the target model, verifying blocks from its pool and its own queue."""
    if draft_placement not in (None, "remote", "local"):
        fail(f"--draft-placement must be remote or local, got {draft_placement!r}")
    apply_env(worker__pool=pool, worker__worker_id=worker_id, num_threads=threads, worker__wide_threads=wide_threads,
              worker__device_kind=device_kind,
              worker__draft_placement=draft_placement, draft=draft)
    from services.config import get_settings
    from verify_worker.main import default_worker_id, run_verify_worker

    settings = get_settings()
    worker_id = settings.worker.worker_id or default_worker_id("verify")
    setup(settings.num_threads, verbose, service="verify-worker", worker_id=worker_id)
    logging.getLogger().setLevel(logging.INFO)
    try:
        run_verify_worker(settings, worker_id=worker_id)
    except MirrorSDError as exc:
        fail(str(exc))
