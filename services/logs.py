"""Log lines of every service: text for a terminal, or one JSON object per line (`log_format: json`,
MIRROR_SD_LOG_FORMAT=json) for a log pipeline that indexes fields instead of parsing prose.

A JSON line carries ts, level, logger, message, service, worker_id and request_id. The request id is
taken, first to last, from the record (`logger.info(..., extra={"request_id": ...})`: code such as the
draft driver or a verify step that serves many requests from one thread), from the context the code
runs in (`request_context`, a contextvar: per asyncio task in the gateway, per thread in the workers),
or from a Celery task line's arguments (a session's task id is its request id, gateway/sessions/submit.py); it is
null on lines about no request.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import datetime, timezone
from typing import Literal

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter

logger = logging.getLogger(__name__)

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"
JSON_FIELDS = "{asctime}{levelname}{name}{message}"
RENAMED = {"asctime": "ts", "levelname": "level", "name": "logger"}
# uvicorn's coloured copy of each message: terminal escapes, not data
DROPPED = ("color_message",)

REQUEST_ID: ContextVar[str | None] = ContextVar("mirror_sd_request_id", default=None)


@contextmanager
def request_context(request_id: str) -> Iterator[None]:
    """Lines logged inside are about `request_id` (a thread or task serving one request for a while)."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


def bind_request(request_id: str) -> None:
    """The rest of this asyncio task is about `request_id`: the gateway runs each HTTP request in a task
    of its own, so the binding ends with the request and never leaks into another."""
    REQUEST_ID.set(request_id)


def _celery_task_id(record: logging.LogRecord) -> str | None:
    """Celery logs task events ("received", "succeeded", ...) with a dict of arguments holding the task id."""
    if record.name.startswith("celery") and isinstance(record.args, Mapping):
        task_id = record.args.get("id")
        return task_id if isinstance(task_id, str) else None
    return None


class ContextFilter(logging.Filter):
    """Stamps every record with the process's service and worker id and the request it is about."""

    def __init__(self, service: str, worker_id: str | None) -> None:
        super().__init__()
        self.service = service
        self.worker_id = worker_id

    def filter(self, record: logging.LogRecord) -> bool:
        record.service = self.service
        record.worker_id = self.worker_id
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get() or _celery_task_id(record)
        return True


class JsonLineFormatter(JsonFormatter):
    """python-json-logger with our field names and ISO 8601 UTC timestamps (milliseconds)."""

    def __init__(self) -> None:
        super().__init__(JSON_FIELDS, style="{", rename_fields=RENAMED,
                         reserved_attrs=[*RESERVED_ATTRS, *DROPPED], json_default=str)

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:  # noqa: N802 - logging's name
        return datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")


def make_handler(*, service: str, worker_id: str | None, log_format: LogFormat) -> logging.Handler:
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter(service, worker_id))
    handler.setFormatter(JsonLineFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    return handler


def configure_logging(*, service: str, worker_id: str | None = None, log_format: LogFormat = "text",
                      level: int | str = logging.INFO) -> None:
    """The process's one log handler, on the root logger: every library's lines (uvicorn, Celery,
    transformers) propagate to it, so with json no line leaves the process in another shape."""
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(make_handler(service=service, worker_id=worker_id, log_format=log_format))
    root.setLevel(level)
    # httpx logs every request at INFO: `up` polling /readyz twice a second would fill its terminal
    logging.getLogger("httpx").setLevel(max(logging.WARNING, root.level))
    logging.captureWarnings(log_format == "json")  # warnings.warn would otherwise print raw text to stderr
