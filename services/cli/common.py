"""What every `mirror-sd` command shares: one-line errors that exit 2, process set-up, flags as settings."""

from __future__ import annotations

import logging
from typing import NoReturn

import typer

logger = logging.getLogger(__name__)


def fail(message: str) -> NoReturn:
    """Bad input: one line naming the bad value, exit code 2 (no traceback for a user's typo)."""
    typer.echo(f"Error: {message}", err=True)
    raise typer.Exit(code=2)


def describe_settings_error(exc: Exception) -> str:
    """A settings ValidationError as one line per bad value, each naming its MIRROR_SD_* variable."""
    lines = []
    for error in exc.errors():  # type: ignore[attr-defined]
        path = [str(part) for part in error.get("loc", ())]
        variable = "MIRROR_SD_" + "__".join(path).upper() if path else "the settings"
        lines.append(f"{'.'.join(path) or 'settings'} ({variable}): {error.get('msg', 'invalid')}")
    return "invalid settings: " + "; ".join(lines)


def service_logging(service: str, *, worker_id: str | None = None, level: int | str = logging.INFO) -> None:
    """The log handler of a service process, in the settings' log_format (text, or one JSON object a line)."""
    from services.config import get_settings
    from services.logs import configure_logging

    configure_logging(service=service, worker_id=worker_id, log_format=get_settings().log_format, level=level)


def setup(num_threads: int | None, verbose: bool, *, service: str = "mirror-sd", worker_id: str | None = None) -> None:
    """Logging and torch threads for a command that runs models (torch is imported only here, on demand)."""
    import torch

    service_logging(service, worker_id=worker_id, level=logging.INFO if verbose else logging.WARNING)
    if not verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if num_threads:
        torch.set_num_threads(num_threads)


def apply_env(**values: object) -> None:
    """CLI flags become MIRROR_SD_* variables, so child processes and get_settings() agree."""
    import os

    for name, value in values.items():
        if value is not None:
            os.environ[f"MIRROR_SD_{name.upper()}"] = str(value)
