"""`mirror-sd up`: the whole stack on this machine as child processes, until Ctrl-C."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from services.cli.common import apply_env, fail, service_logging

logger = logging.getLogger(__name__)


def up(
    port: Annotated[int, typer.Option(help="gateway port")] = 8000,
    auth_disabled: Annotated[bool, typer.Option("--auth-disabled/--auth", help="development only")] = True,
    draft: Annotated[str | None, typer.Option(help="draft spec for the draft worker (default: settings)")] = None,
    pin: Annotated[bool, typer.Option("--pin/--no-pin", help="draft and verify workers on separate cores")] = False,
) -> None:
    """Run the local stack (gateway, draft worker, verify worker) with the built-in model until Ctrl-C."""
    import signal as signal_lib
    import threading

    from services.config import get_settings
    from services.stack import start_stack, stop_children
    from services.storage.db import init_db

    apply_env(gateway__auth_disabled=str(auth_disabled).lower(), draft=draft)
    service_logging("up")
    settings = get_settings()
    init_db(settings.database_url)  # migrate once, before the children race to it
    typer.echo(f"starting gateway on :{port}, a draft worker and a verify worker ({settings.target}) ...", err=True)
    try:
        children, private = start_stack(redis_url=settings.redis_url, port=port, draft=settings.draft, pin=pin)
    except RuntimeError as exc:
        fail(str(exc))
    typer.echo(
        f"ready. Try:\n  curl -s localhost:{port}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{settings.target}\", \"messages\": [{{\"role\": \"user\", \"content\": "
        f"\"Say hello\"}}], \"max_tokens\": 32}}'\nCtrl-C stops everything.",
        err=True,
    )
    stop = threading.Event()
    for signum in (signal_lib.SIGINT, signal_lib.SIGTERM):
        signal_lib.signal(signum, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            dead = [name for name, child in children.items() if child.poll() is not None]
            if dead:
                typer.echo(f"{', '.join(dead)} exited; stopping the stack", err=True)
                break
    finally:
        stop_children(children)
        if private is not None:
            private.stop()
