"""`mirror-sd`: the command line for the whole suite, one module per service or concern.

Importing this package builds the command tree and nothing more: each command
imports what it runs (torch, a model, an app such as gateway/ or
verify_worker/) inside its own function, so `mirror-sd --help` stays quick
and the core never depends on the apps. Errors from bad input print one line
naming the bad value and exit 2 (`services/cli/common.py`).
"""

from __future__ import annotations

import logging
from enum import Enum
from typing import Annotated

import typer

from services.cli.common import apply_env, describe_settings_error
from services.cli import (
    bench,
    distill,
    draft_worker,
    drill,
    gateway,
    generate,
    keys,
    link,
    llamacpp,
    models,
    status,
    telemetry,
    up,
    verify_worker,
)

logger = logging.getLogger(__name__)

app = typer.Typer(help="Mirror-SD: distributed speculative decoding.", no_args_is_help=True, add_completion=False)


class LogFormat(str, Enum):
    text = "text"
    json = "json"


@app.callback()
def global_options(
    log_format: Annotated[LogFormat | None, typer.Option(
        "--log-format",
        help="json: one JSON object per log line, in this process and the ones it starts (MIRROR_SD_LOG_FORMAT)",
    )] = None,
) -> None:
    """Mirror-SD: distributed speculative decoding."""
    # an env variable, so that get_settings() and child processes (`mirror-sd up`) log the same way
    apply_env(log_format=log_format.value if log_format else None)


app.add_typer(models.app, name="models")
app.add_typer(telemetry.app, name="telemetry")
app.add_typer(keys.app, name="keys")
app.add_typer(drill.app, name="drill")
app.add_typer(llamacpp.app, name="llamacpp")
app.command()(generate.generate)
app.command()(bench.bench)
app.command()(distill.distill)
app.command("verify-worker")(verify_worker.verify_worker_command)
app.command("draft-worker")(draft_worker.draft_worker_command)
app.command()(up.up)
app.command()(status.status)
# a negative RTT (`link -5`) reaches the command's own check, which names it, instead of "no such option"
app.command("link", context_settings={"ignore_unknown_options": True})(link.link_command)
app.command("gateway")(gateway.gateway_command)


def main() -> None:  # pragma: no cover - console entry point
    from pydantic import ValidationError

    try:
        app()
    except ValidationError as exc:  # a bad MIRROR_SD_* value or config file, met by whichever command read it
        if exc.title != "Settings":
            raise
        typer.echo(f"Error: {describe_settings_error(exc)}", err=True)
        raise SystemExit(2) from None
