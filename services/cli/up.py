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
    target: Annotated[str | None, typer.Option(help="target model (default: settings), e.g. random:llama-1b: random "
                                               "weights of that shape, for system benches (docs/synthetic.md)")] = None,
    draft: Annotated[str | None, typer.Option(help="draft spec for the draft worker (default: settings), e.g. "
                                              "synthetic:0.9@8ms (docs/synthetic.md)")] = None,
    pin: Annotated[bool, typer.Option("--pin/--no-pin", help="draft and verify workers on separate cores "
                                      "(placement auto becomes remote)")] = False,
    verify_pools: Annotated[str | None, typer.Option(
        "--verify-pools", help="verify workers per pool, name=count, e.g. accel=1,cpu=1 (default: one worker on "
        "worker.pool)")] = None,
    accelerator_pools: Annotated[str | None, typer.Option(
        "--accelerator-pools", help="pools of --verify-pools whose workers report device kind 'accelerator' "
        "(thermal drills on a CPU-only box), e.g. accel")] = None,
    draft_placement: Annotated[str, typer.Option(
        "--draft-placement", help="local: the verify workers draft for their own sessions on every core; remote: a "
        "draft worker of its own (the fleet's layout); auto: local when the target runs on the CPU of a box of "
        "at most 2 cores, else remote")] = "auto",
    draft_link: Annotated[str | None, typer.Option(
        "--draft-link", metavar="RTT_MS[:JITTER_MS]", help="drafts at the edge: the draft worker reaches Redis "
        "(and its Celery broker) through a link that adds RTT_MS to every round trip, plus a random 0..JITTER_MS, "
        "e.g. 20 or 20:5. Needs a draft worker: placement auto becomes remote, local is refused")] = None,
    gateways: Annotated[int, typer.Option(min=1, help="gateway processes on the port (SO_REUSEPORT), sharing "
                                          "admission limits through Redis (docs/operations.md)")] = 1,
) -> None:
    """Run the local stack (gateway, draft worker, verify workers, telemetry) with the built-in model until Ctrl-C."""
    from services.config import get_settings
    from services.pools import fallback_pool, parse_verify_pools
    from services.stack import choose_placement, start_stack
    from services.supervisor import StopSignals, supervise
    from services.storage.db import init_db

    signals = StopSignals().install()  # a second Ctrl-C: no more waiting
    stop = signals.stop
    link = _parse_draft_link(draft_link, draft_placement)
    pools = None
    if accelerator_pools and not verify_pools:
        fail("--accelerator-pools names pools of --verify-pools; give --verify-pools too (e.g. accel=1,cpu=1)")
    if verify_pools is not None:
        try:
            pools = parse_verify_pools(verify_pools, accelerator_pools)
            fallback = fallback_pool(pools, get_settings().telemetry.fallback_pool) if any(
                p.accelerator for p in pools) else None
        except ValueError as exc:
            fail(str(exc))
        apply_env(telemetry__fallback_pool=fallback)
    apply_env(gateway__auth_disabled=str(auth_disabled).lower(), draft=draft, target=target)
    get_settings.cache_clear()  # the flags above are settings now
    service_logging("up")
    settings = get_settings()
    _say_synthetic(settings)
    init_db(settings.database_url)  # migrate once, before the children race to it
    try:
        placement = choose_placement(draft_placement, settings.device, draft_worker=bool(link) or pin)
    except ValueError as exc:
        fail(f"--draft-placement: {exc}")
    described = ", ".join(f"{p.name}={p.count}{' (accelerator)' if p.accelerator else ''}" for p in pools or [])
    drafting = ("drafting for their own sessions (placement local)" if placement == "local"
                else "and a draft worker (placement remote)" + (f" behind a link ({link.describe()})" if link else ""))
    front = f"{gateways} gateways" if gateways > 1 else "gateway"
    typer.echo(f"starting {front} on :{port}, verify workers {described or 'on ' + settings.worker.pool} "
               f"({settings.target}) {drafting}, and telemetry ...", err=True)
    try:
        supervisor, private = start_stack(redis_url=settings.redis_url, port=port, draft=settings.draft, pin=pin,
                                          verify_pools=pools, stop=stop, placement=placement, draft_link=link,
                                          gateways=gateways)
    except RuntimeError as exc:
        if stop.is_set():
            raise typer.Exit(0) from None  # Ctrl-C while starting: stopped, as asked
        fail(str(exc))
    signals.supervisor = supervisor
    if private is not None:  # other shells' mirror-sd status / telemetry commands must find this Redis
        typer.echo(f"private Redis at {private.url}: in another shell, export MIRROR_SD_REDIS_URL={private.url}",
                   err=True)
    _say_fallbacks(port)
    typer.echo(f"dashboard: http://127.0.0.1:{port}/dashboard", err=True)
    typer.echo(
        f"ready. Try:\n  curl -s localhost:{port}/v1/chat/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\": \"{settings.target}\", \"messages\": [{{\"role\": \"user\", \"content\": "
        f"\"Say hello\"}}], \"max_tokens\": 32}}'\nCtrl-C stops everything.",
        err=True,
    )
    code = 0
    try:
        gave_up = supervise(supervisor, stop)
        if gave_up is not None:
            typer.echo(f"{gave_up}; stopping the stack", err=True)
            code = 1
    finally:
        typer.echo("stopping: the gateway drains its streams first ...", err=True)
        supervisor.stop()
        supervisor.publish()
        if private is not None:
            private.stop()
    raise typer.Exit(code)


def _say_synthetic(settings) -> None:
    """A random-weight target or a synthetic draft, said at the front before anything starts (a bad spec exits
    2 naming it)."""
    from services.models.synthetic_spec import is_synthetic_spec, parse_synthetic_spec
    from services.models.random_spec import is_random_spec, parse_random_spec
    from services.synthetic import describe_label, synthetic_label

    try:
        if is_random_spec(settings.target):
            parse_random_spec(settings.target)
        if is_synthetic_spec(settings.draft):
            parse_synthetic_spec(settings.draft)
    except ValueError as exc:
        fail(str(exc))
    label = synthetic_label(settings.target, settings.draft)
    if label:
        typer.echo(f"{describe_label(label)} (docs/synthetic.md)", err=True)


def _parse_draft_link(text: str | None, placement: str):
    """--draft-link's LinkSpec (None without one); a bad value, or local placement, exits 2 naming it."""
    if text is None:
        return None
    from services.link.spec import parse_link

    try:
        link = parse_link(text)
    except ValueError as exc:
        fail(f"--draft-link: {exc}")
    if placement == "local":
        fail(f"--draft-link {text} puts draft workers behind a link, and --draft-placement local runs none (the "
             "verify workers draft in-process); use --draft-placement remote (or auto)")
    return link


def _say_fallbacks(port: int) -> None:
    """Once, at the front: a draft worker serving with a fallback draft (its model draft cannot run here)."""
    import httpx

    from services.protocol import DraftFallback

    try:
        fallbacks = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5).json().get("draft_fallbacks", [])
    except (httpx.HTTPError, ValueError):
        return
    for entry in fallbacks:
        worker = entry.pop("worker", "a draft worker")
        typer.echo(f"warning: {worker}: {DraftFallback.from_wire(entry).describe()} (lossless, slower; see "
                   "`mirror-sd llamacpp check`)", err=True)
