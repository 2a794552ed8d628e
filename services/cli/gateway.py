"""`mirror-sd gateway`: the HTTP API under uvicorn (gateway/ is imported by uvicorn, only when it runs)."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from services.cli.common import apply_env, fail, service_logging

logger = logging.getLogger(__name__)


def gateway_command(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    auth_disabled: Annotated[bool | None, typer.Option("--auth-disabled/--auth", help="development only")] = None,
) -> None:
    """Run the OpenAI-compatible HTTP gateway."""
    apply_env(gateway__host=host, gateway__port=port,
               gateway__auth_disabled=None if auth_disabled is None else str(auth_disabled).lower())
    import uvicorn

    from services.config import get_settings

    try:
        settings = get_settings()
    except ValueError as exc:
        fail(str(exc))
    import socket

    service_logging("gateway", worker_id=f"gateway-{socket.gethostname()}-{settings.gateway.port}")
    # json: uvicorn's own config would put text handlers on its loggers; without it they propagate to ours
    log_config = None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG
    from gateway.drain import DrainingServer

    config = uvicorn.Config("gateway.app:create_app", factory=True, host=settings.gateway.host,
                            port=settings.gateway.port, log_level="info", log_config=log_config,
                            timeout_graceful_shutdown=5,
                            # longer than clients keep idle connections (httpx: 5 s), so a client never
                            # reuses a connection the server is closing at that moment
                            timeout_keep_alive=75,
                            access_log=False)  # the gateway writes its own, with durations (gateway/access_log.py)
    DrainingServer(config, drain_timeout_s=settings.gateway.drain_timeout_s).run()
