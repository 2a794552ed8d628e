"""`mirror-sd gateway`: the HTTP API under uvicorn (gateway/ is imported by uvicorn, only when it runs); with
`--workers N`, N of them on one port (services/gateways.py)."""

from __future__ import annotations

import logging
import os
import sys
from typing import Annotated

import typer

from services.cli.common import apply_env, fail, service_logging

logger = logging.getLogger(__name__)


def gateway_command(
    host: Annotated[str | None, typer.Option()] = None,
    port: Annotated[int | None, typer.Option()] = None,
    auth_disabled: Annotated[bool | None, typer.Option("--auth-disabled/--auth", help="development only")] = None,
    workers: Annotated[int, typer.Option(min=1, help="gateway processes on this port (SO_REUSEPORT), sharing "
                                         "admission limits through Redis and restarted when they die")] = 1,
    reuse_port: Annotated[bool, typer.Option("--reuse-port", hidden=True,
                                             help="one of several processes on the port (set by --workers)")] = False,
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
    if workers > 1:
        raise typer.Exit(_run_workers(workers, settings))
    import socket

    suffix = f"-{os.getpid()}" if reuse_port else ""
    service_logging("gateway", worker_id=f"gateway-{socket.gethostname()}-{settings.gateway.port}{suffix}")
    # json: uvicorn's own config would put text handlers on its loggers; without it they propagate to ours
    log_config = None if settings.log_format == "json" else uvicorn.config.LOGGING_CONFIG
    from gateway.drain import DrainingServer

    config = uvicorn.Config("gateway.app:create_app", factory=True, host=settings.gateway.host,
                            port=settings.gateway.port, log_level="info", log_config=log_config,
                            timeout_graceful_shutdown=5,
                            # longer than clients keep idle connections (httpx: 5 s), so a client never
                            # reuses a connection the server is closing at that moment
                            timeout_keep_alive=75,
                            # the gateway writes its own, with durations (gateway/observability/access_log.py)
                            access_log=False)
    sockets = None
    if reuse_port:
        from services.gateways import reuse_port_socket

        try:
            sockets = [reuse_port_socket(settings.gateway.host, settings.gateway.port)]
        except OSError as exc:
            fail(f"cannot bind {settings.gateway.host}:{settings.gateway.port} with SO_REUSEPORT: {exc}")
    DrainingServer(config, drain_timeout_s=settings.gateway.drain_timeout_s).run(sockets=sockets)


def _run_workers(count: int, settings) -> int:
    """N gateway processes, supervised as `up` supervises its children: one that dies is started again; SIGTERM
    (or Ctrl-C) drains them all, a second one stops them at once. Exit 0 once they have drained."""
    from services.gateways import GatewayGroup
    from services.supervisor import Child, StopSignals, Supervisor, supervise

    service_logging("gateway")
    signals = StopSignals().install()
    group = GatewayGroup(count)
    command = [sys.executable, "-m", "services.cli", "gateway"]
    grace_s = settings.gateway.drain_timeout_s + 10
    children = {name: Child(name, child_command, env, grace_s=grace_s, essential=True)
                for name, (child_command, env) in group.children(command, dict(os.environ)).items()}
    supervisor = signals.supervisor = Supervisor(children, on_change=group.on_change)
    logger.info("%d gateway processes on %s:%d, admission shared in Redis", count, settings.gateway.host,
                settings.gateway.port)
    supervisor.start()
    try:
        gave_up = supervise(supervisor, signals.stop)
        if gave_up is not None:
            typer.echo(f"{gave_up}; stopping the gateways", err=True)
        return 0 if gave_up is None else 1
    finally:
        supervisor.stop()
        group.close()
