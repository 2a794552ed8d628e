"""`mirror-sd telemetry run`: the routing-table service until SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import signal
import threading

from services.config import Settings
from services.redis_conn import connect
from services.storage.db import create_db_engine, session_factory
from telemetry.metrics import serve_metrics
from telemetry.service import TelemetryService

logger = logging.getLogger(__name__)


def run_telemetry(settings: Settings) -> None:
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    service = TelemetryService(settings=settings, client=connect(settings.redis_url),
                               db=session_factory(create_db_engine(settings.database_url)))
    serve_metrics(service.metrics, settings.telemetry.metrics_host, settings.telemetry.metrics_port)
    logger.info("telemetry service: routing table every %.2fs", settings.telemetry.interval_s)
    service.serve(stop)


def parse_duration(text: str) -> float:
    """'30s', '2m', '1h' or plain seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    text = text.strip().lower()
    try:
        if text and text[-1] in units:
            value = float(text[:-1]) * units[text[-1]]
        else:
            value = float(text)
    except ValueError:
        raise ValueError(f"duration must look like 30s, 2m or 1h, got {text!r}") from None
    if value <= 0:
        raise ValueError(f"duration must be positive, got {text!r}")
    return value
