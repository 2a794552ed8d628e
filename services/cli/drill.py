"""`mirror-sd drill`: operator drills against a running stack (the thermal one lives in `mirror-sd telemetry`)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated

import typer

from services.cli.common import fail

logger = logging.getLogger(__name__)

app = typer.Typer(help="Operator drills against a running stack.", no_args_is_help=True)

ROLES = ("draft", "verify")


@app.command("chaos")
def chaos(
    url: Annotated[str, typer.Option(help="gateway")] = "http://127.0.0.1:8000",
    kills: Annotated[int, typer.Option(help="kill -9s of random draft/verify workers on this host")] = 10,
    every: Annotated[float, typer.Option(help="seconds between kills (after the last one's role is back)")] = 2.0,
    requests: Annotated[int, typer.Option(help="dev prompts, each asked once for the reference and then again "
                                          "under chaos (more rounds while kills remain)")] = 20,
    concurrency: Annotated[int, typer.Option(help="requests in flight during the chaos")] = 4,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 48,
    roles: Annotated[str, typer.Option(help="worker roles to kill: draft,verify")] = "draft,verify",
    restart_redis: Annotated[bool, typer.Option(
        "--restart-redis/--no-restart-redis",
        help="also SHUTDOWN Redis once mid-run; something must start it again (mirror-sd up's supervisor does "
             "for its private Redis; compose's restart policy)")] = False,
    failover: Annotated[bool, typer.Option(
        "--failover/--no-failover",
        help="also kill -9 the Redis primary once mid-run (redis_url must be redis+sentinel://, the primary on "
             "this host); reports the sentinels' promotion and the first request served after the kill")] = False,
    prompts: Annotated[Path | None, typer.Option(help="prompt file (default: the dev set)")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    out: Annotated[Path | None, typer.Option(help="write the report as JSON here")] = None,
) -> None:
    """Run dev prompts under load while kill -9-ing random workers; report completed, identical to `ar`, lost,
    doubled."""
    from services.bench.prompts import DEV_PROMPTS_PATH, load_prompts, select_prompts
    from services.config import get_settings
    from services.redis_conn import connect
    from services.redis_url import is_sentinel, redacted
    from services.drills.chaos import run_chaos

    chosen_roles = tuple(role.strip() for role in roles.split(",") if role.strip())
    bad = [role for role in chosen_roles if role not in ROLES]
    if bad or not chosen_roles:
        fail(f"--roles: {roles!r}: choose from {', '.join(ROLES)}")
    if kills < 0 or requests < 1 or concurrency < 1 or max_tokens < 1:
        fail("--kills must be >= 0 and --requests, --concurrency, --max-tokens >= 1")
    try:
        chosen = select_prompts(load_prompts(prompts or DEV_PROMPTS_PATH), limit=requests)
    except ValueError as exc:
        fail(f"--prompts: {exc}")
    settings = get_settings()
    if failover and not is_sentinel(settings.redis_url):
        fail(f"--failover needs a redis+sentinel:// redis_url (MIRROR_SD_REDIS_URL), "
             f"got {redacted(settings.redis_url)!r}")
    if failover and restart_redis:
        fail("--failover and --restart-redis: choose one")
    client = connect(settings.redis_url)
    if restart_redis:
        check_redis_comes_back(client, redacted(settings.redis_url))
    try:
        report = run_chaos(url, client, chosen, model=settings.gateway.model_name or settings.target,
                           kills=kills, concurrency=concurrency, max_tokens=max_tokens, every_s=every,
                           roles=chosen_roles, restart_redis=restart_redis, seed=seed,
                           failover_url=settings.redis_url if failover else None)
    except RuntimeError as exc:
        fail(str(exc))
    by_role = {role: sum(1 for k in report.kills if k.role == role) for role in chosen_roles}
    backs = sorted(k.back_after_s for k in report.kills if k.back_after_s is not None)
    typer.echo(f"{report.requests} requests under {len(report.kills)} kill -9s ({by_role}) in {report.wall_s:.0f}s: "
               f"{report.completed} completed, {report.identical} identical to ar, {report.lost} lost, "
               f"{report.doubled} doubled, {report.mismatched} other mismatches")
    if backs:
        typer.echo(f"worker back after a kill: median {backs[len(backs) // 2]:.1f}s, max {backs[-1]:.1f}s; "
                   f"{sum(k.back_after_s is None for k in report.kills)} never came back")
    if report.redis_restart_s is not None:
        typer.echo(f"Redis answered again {report.redis_restart_s:.1f}s after SHUTDOWN"
                   if report.redis_restart_s != float("inf") else
                   "Redis did not answer again after SHUTDOWN within the drill's wait")
    if report.failover is not None:
        shown = {key: "never" if value is None else f"{value:.1f}s" for key, value in report.failover.items()
                 if key.endswith("_s")}
        typer.echo(f"failover: primary {report.failover['old_primary']} killed -9; {report.failover['new_primary']} "
                   f"promoted after {shown['promoted_s']}; first request served {shown['served_s']} after the kill")
    for error in report.errors[:10]:
        typer.echo(f"  {error}", err=True)
    if out is not None:
        out.write_text(json.dumps(report.to_dict(), indent=2))
    if report.lost or report.doubled or report.mismatched:
        raise typer.Exit(1)


@app.command("burst")
def burst(
    url: Annotated[str, typer.Option(help="gateway")] = "http://127.0.0.1:8000",
    requests: Annotated[int, typer.Option(help="requests sent at once")] = 1000,
    max_tokens: Annotated[int, typer.Option("--max-tokens")] = 8,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="MIRROR_SD_API_KEY")] = None,
    out: Annotated[Path | None, typer.Option(help="write the report as JSON here")] = None,
    settle_s: Annotated[float, typer.Option("--settle-s", min=0, help="pause between opening the connections and "
                                            "sending (0: send as soon as all are open)")] = 0.0,
) -> None:
    """Send N requests at once: every answer must be 200, 503 or 429 with Retry-After; report how fast the
    refusals came."""
    from services.config import get_settings
    from services.drills.burst import run_burst

    if requests < 1 or max_tokens < 1:
        fail("--requests and --max-tokens must be >= 1")
    settings = get_settings()
    report = run_burst(url, model=settings.gateway.model_name or settings.target, count=requests,
                       max_tokens=max_tokens, api_key=api_key, settle_s=settle_s)
    typer.echo(f"{requests} requests at once in {report.wall_s:.1f}s: statuses {report.statuses}; refusals "
               f"p50 {report.reject_ms['p50']} ms, p99 {report.reject_ms['p99']} ms, max {report.reject_ms['max']} ms; "
               f"served p50 {report.ok_ms['p50']} ms")
    for error in report.errors:
        typer.echo(f"  {error}", err=True)
    if out is not None:
        out.write_text(json.dumps({**report.__dict__}, indent=2))
    if not report.only_expected:
        typer.echo(f"unexpected answers: {report.statuses}, {report.missing_retry_after} refusals without "
                   "Retry-After", err=True)
        raise typer.Exit(1)


def check_redis_comes_back(client, shown_url: str) -> None:
    """--restart-redis SHUTDOWNs the stack's Redis: refuse when `mirror-sd up` supervises the stack but not its
    Redis (an external one: nothing would start it again, and its other users would lose it too). Without a
    supervisor (compose, a fleet across hosts) the operator's restart policy is trusted, as the help says."""
    from services.redis_client import read_children

    try:
        names = sorted(child.name for child in read_children(client))
    except Exception as exc:  # Redis away, or not Redis: the drill cannot start anyway
        fail(f"--restart-redis: cannot read the stack's supervisor from Redis at {shown_url}: {exc}")
    if names and "redis" not in names:
        fail(f"--restart-redis: the stack's Redis ({shown_url}) is not one `mirror-sd up` runs (its supervisor "
             f"runs {', '.join(names)}): nothing would start it again after the SHUTDOWN. Run the drill against a "
             "stack with its own Redis (`mirror-sd up` without MIRROR_SD_REDIS_URL), or without --restart-redis")
