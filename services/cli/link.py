"""`mirror-sd link`: a delayed link in front of Redis, alone, for any process to sit behind."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from services.cli.common import fail, service_logging

logger = logging.getLogger(__name__)


def link_command(
    link: Annotated[str, typer.Argument(metavar="RTT_MS[:JITTER_MS]", help="what the link adds to a round trip: "
                                        "RTT_MS always (half each way), plus a random 0..JITTER_MS")],
    to: Annotated[str | None, typer.Option("--to", help="the Redis to forward to (default: settings' redis_url)")]
    = None,
    host: Annotated[str, typer.Option(help="address to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port to listen on (0: any free one)")] = 0,
    name: Annotated[str, typer.Option(help="its name in Redis: the bench's --draft-link levels change the link of "
                                      "this name while it runs, `mirror-sd status` shows it")] = "draft",
    control: Annotated[bool, typer.Option("--control/--no-control", help="publish its status and take setting "
                                          "changes through the Redis it forwards to")] = True,
    seed: Annotated[int | None, typer.Option(help="seed of the jitter")] = None,
) -> None:
    """Forward TCP to Redis through a link that delays (and optionally jitters) every chunk, until Ctrl-C.

    Put a process behind it with MIRROR_SD_REDIS_URL set to the URL it prints (a draft worker on another
    shell, a bench, a drill); `mirror-sd up --draft-link` does this for its draft workers."""
    import asyncio

    from services.config import get_settings
    from services.link.control import serve
    from services.link.proxy import LinkProxy
    from services.link.spec import behind_link, parse_link, redis_address

    try:
        spec = parse_link(link)
    except ValueError as exc:
        fail(f"link: {exc}")
    if not 0 <= port <= 65535:
        fail(f"--port must be 0..65535, got {port}")
    upstream_url = to or get_settings().redis_url
    try:
        upstream_host, upstream_port = redis_address(upstream_url)
    except ValueError as exc:
        fail(f"--to: {exc}")
    service_logging("link")
    proxy = LinkProxy(spec, upstream_host, upstream_port, host=host, port=port, seed=seed)

    def ready(running: LinkProxy) -> None:
        url = behind_link(upstream_url, running.host, running.port)
        typer.echo(f"link {name}: {running.host}:{running.port} -> {upstream_host}:{upstream_port}, "
                   f"{spec.describe()}. Behind it: MIRROR_SD_REDIS_URL={url}", err=True)

    try:
        asyncio.run(serve(proxy, redis_url=upstream_url if control else None, name=name, ready=ready))
    except OSError as exc:  # the port is taken, the address is not ours
        fail(f"cannot listen on {host}:{port}: {exc}")
