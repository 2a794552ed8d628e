"""`mirror-sd status`: what the heartbeats and the routing table say right now."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

logger = logging.getLogger(__name__)


def status(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Workers, pools, temperatures, utilization, acceptance and routing weights."""
    import json as json_lib
    import time

    import redis

    from services.config import get_settings
    from services.link.control import read_link
    from services.protocol import DRAFT_LINK
    from services.redis_client import read_children, read_heartbeats, read_routing_table
    from services.redis_conn import connect, describe_redis
    from services.synthetic import worker_synthetic

    url = get_settings().redis_url
    client = connect(url)
    redis_line = describe_redis(url)
    try:
        beats = sorted(read_heartbeats(client), key=lambda b: (b.role, b.pool, b.worker_id))
        table = read_routing_table(client)
        children = read_children(client)
        link = read_link(client, DRAFT_LINK)
    except (redis.ConnectionError, redis.TimeoutError) as exc:  # nothing to show: one line, not a traceback
        typer.echo(f"Error: cannot reach Redis at {redis_line} ({exc}); is the stack up? "
                   "(MIRROR_SD_REDIS_URL names the Redis to read)", err=True)
        raise typer.Exit(code=1) from None
    if as_json:
        typer.echo(json_lib.dumps({"redis": redis_line, "workers": [b.to_dict() for b in beats],
                                   "routing": table.to_dict() if table else None,
                                   "children": [child.to_dict() for child in children],
                                   "draft_link": link.to_dict() if link else None}))
        return
    typer.echo(f"redis: {redis_line}")
    typer.echo(f"{'worker':32} {'role':7} {'pool':6} {'device':11} {'temp':>6} {'util':>5} {'accept':>6} "
               f"{'p99 ms':>7} {'sessions':>8} {'age':>5}")
    for b in beats:
        temp = f"{b.temperature_c:.0f}C" if b.temperature_c is not None else "-"
        accept = f"{b.acceptance_rate:.2f}" if b.acceptance_rate is not None else "-"
        p99 = f"{b.latency_p99_ms:.0f}" if b.latency_p99_ms is not None else "-"
        typer.echo(f"{b.worker_id:32} {b.role:7} {b.pool:6} {b.device_kind:11} {temp:>6} {b.utilization:5.2f} "
                   f"{accept:>6} {p99:>7} {b.num_sessions:8d} {time.time() - b.sent_at:4.1f}s")
    if table is None:
        typer.echo("routing: no table yet (is `mirror-sd telemetry run` up?)")
    else:
        weights = ", ".join(f"{pool} {weight:.2f}" for pool, weight in table.pool_weights.items())
        typer.echo(f"routing v{table.version}: {weights}; ar {table.ar_pools or '-'}; degraded "
                   f"{table.degraded_pools or '-'}; hot {table.hot_workers or '-'}; alerts {table.alerts or '-'}")
    for beat in beats:
        synthetic = worker_synthetic(beat.model, beat.local_draft)
        if synthetic:
            typer.echo(f"SYNTHETIC: {beat.worker_id}: {synthetic} (docs/synthetic.md)")
        if beat.local_draft:
            typer.echo(f"placement local: {beat.worker_id} drafts for its own sessions with {beat.local_draft}")
        if beat.local_turns:  # co-located: its turns; remote drafts: its steps behind its word on the load
            typer.echo(f"  {beat.worker_id}: measured {'turns' if beat.local_draft else 'steps'}, tok/s by load: "
                       + "; ".join(f"{load}: " + ", ".join(f"{arm} {rate:.0f}" for arm, rate in sorted(arms.items()))
                                   for load, arms in sorted(beat.local_turns.items(), key=lambda item: int(item[0]))))
        if beat.draft_fallback is not None:
            typer.echo(f"fallback: {beat.worker_id}: {beat.draft_fallback.describe()}")
        if beat.link is not None:
            typer.echo(f"link: {beat.worker_id}: {beat.link.describe()}")
    if link is not None:
        jitter = f" + jitter up to {link.jitter_ms:g} ms" if link.jitter_ms else ""
        typer.echo(f"draft link: {link.listen} -> {link.upstream}, RTT {link.rtt_ms:g} ms{jitter}, "
                   f"{link.connections} connections")
    if children:
        typer.echo("processes (mirror-sd up): " + ", ".join(
            f"{child.name} {child.state}" + (f" ({child.restarts} restarts, last {child.last_exit})"
                                             if child.restarts else "") for child in children))
    for child in children:
        if child.state == "failed":
            typer.echo(f"failed: {child.detail}")
        elif child.fallback:
            typer.echo(f"restarted with a fallback: {child.name}: {child.fallback}")
