"""`mirror-sd telemetry`: the routing-table service, probe overrides and the thermal drill.

telemetry/ is imported only inside the command that uses it."""

from __future__ import annotations

import logging
from typing import Annotated

import typer

from services.cli.common import fail, service_logging

logger = logging.getLogger(__name__)

app = typer.Typer(help="Telemetry: routing-table service and probe overrides.", no_args_is_help=True)


@app.command("run")
def telemetry_run() -> None:
    """Turn heartbeats into the routing table (fallback rules), every telemetry.interval_s."""
    import socket

    from services.config import get_settings
    from telemetry.main import run_telemetry

    service_logging("telemetry", worker_id=f"telemetry-{socket.gethostname()}")
    run_telemetry(get_settings())


@app.command("inject")
def telemetry_inject(
    worker: Annotated[str, typer.Option(help="worker id (see mirror-sd status)")],
    temperature: Annotated[float | None, typer.Option(help="degrees C")] = None,
    utilization: Annotated[float | None, typer.Option(help="0..1")] = None,
    memory: Annotated[float | None, typer.Option(help="used fraction 0..1")] = None,
    device_kind: Annotated[str | None, typer.Option("--device-kind", help="e.g. cuda")] = None,
    duration: Annotated[str, typer.Option("--for", help="how long, e.g. 30s, 2m")] = "30s",
    clear: Annotated[bool, typer.Option("--clear", help="remove the override now")] = False,
) -> None:
    """Override a worker's probe readings for a while (tests and drills)."""
    import time

    import msgpack

    from services.config import get_settings
    from services.protocol import probe_override_key
    from services.redis_conn import connect
    from telemetry.main import parse_duration

    client = connect(get_settings().redis_url)
    if clear:
        client.delete(probe_override_key(worker))
        typer.echo(f"cleared the override of {worker}")
        return
    try:
        seconds = parse_duration(duration)
        if utilization is not None and not 0 <= utilization <= 1:
            raise ValueError(f"--utilization must be in 0..1, got {utilization}")
    except ValueError as exc:
        fail(str(exc))
    override = {"temperature_c": temperature, "utilization": utilization, "memory_used_frac": memory,
                "expires_at": time.time() + seconds}
    if device_kind:
        override["device_kind"] = device_kind
    client.set(probe_override_key(worker), msgpack.packb(override), ex=int(seconds) + 1)
    typer.echo(f"override on {worker} for {seconds:.0f}s: "
               + ", ".join(f"{k}={v}" for k, v in override.items() if v is not None and k != "expires_at"))


@app.command("drill")
def telemetry_drill(
    worker: Annotated[str, typer.Option(help="an accelerator-pool verify worker")],
    temperature: Annotated[float, typer.Option()] = 90.0,
    url: Annotated[str, typer.Option(help="gateway")] = "http://127.0.0.1:8000",
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="MIRROR_SD_API_KEY")] = None,
    hold: Annotated[str, typer.Option("--hold", help="keep the heat on this long after the reroute (watch the "
                                      "dashboard), e.g. 10s")] = "3s",
) -> None:
    """Inject a temperature, time the routing change and the first request that follows it, hold, clear it and
    time the way back."""
    from services.config import get_settings
    from services.redis_conn import connect
    from services.drills.thermal import run_drill
    from telemetry.main import parse_duration

    settings = get_settings()
    try:
        hold_s = parse_duration(hold)
    except ValueError as exc:
        fail(f"--hold: {exc}")
    try:
        result = run_drill(connect(settings.redis_url), worker=worker, temperature=temperature, url=url,
                           model=settings.gateway.model_name or settings.target, api_key=api_key, hold_s=hold_s)
    except TimeoutError as exc:
        fail(str(exc))
    typer.echo(f"{temperature:.0f} C on {worker}: routing v{result.routing_version} {result.pool_weights} after "
               f"{result.to_routing_change_s * 1000:.0f} ms; first request on pool {result.first_rerouted_pool!r} "
               f"{result.to_first_rerouted_request_s * 1000:.0f} ms after the injection")
    typer.echo(f"override cleared after {hold_s:.0f}s hold: {worker} cooled, routing back to {result.recovered_weights} "
               f"after {result.to_recovery_s * 1000:.0f} ms")
