"""The Celery app (control path): one session = one task on queue `draft.<pool>`.

msgpack only (never pickle); acks_late + reject_on_worker_lost so a session
whose draft worker dies is redelivered; priority 0 (high) .. 2 (low) served
in order from Redis through kombu's priority lists.
"""

from __future__ import annotations

import logging

from celery import Celery

from services.celery_transport import SENTINEL_TRANSPORT, TRANSPORT
from services.config import Settings
from services.protocol import DEFAULT_POOL, draft_queue
from services.redis_url import celery_broker

logger = logging.getLogger(__name__)

PRIORITY_LEVELS = {"high": 0, "normal": 1, "low": 2}
# Sending a session's task rides out a Redis restart or a Sentinel failover of a few seconds (0, 0.5, 1, 1, ...
# s between tries, about 8 s in all) instead of failing the request; kombu's default gives up after about 0.6 s.
PUBLISH_RETRY_POLICY = {"max_retries": 9, "interval_start": 0.0, "interval_step": 0.5, "interval_max": 1.0}


def create_celery_app(settings: Settings) -> Celery:
    broker, backend, sentinel_options = celery_broker(settings.redis_url)
    app = Celery("mirror_sd", broker=broker, backend=backend)
    app.conf.update(
        task_serializer="msgpack",
        result_serializer="msgpack",
        accept_content=["msgpack", "json"],
        result_accept_content=["msgpack", "json"],
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        task_default_queue=draft_queue(DEFAULT_POOL),
        task_default_priority=PRIORITY_LEVELS["normal"],
        worker_prefetch_multiplier=1,
        worker_send_task_events=True,  # Flower and `celery events`
        task_send_sent_event=True,
        task_publish_retry=True,
        task_publish_retry_policy=PUBLISH_RETRY_POLICY,
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # a Redis outage is waited out, never a reason to exit
        # kombu's Redis transport (or its Sentinel one), riding out an outage (services/celery_transport.py)
        broker_transport=SENTINEL_TRANSPORT if sentinel_options else TRANSPORT,
        result_backend_transport_options={key: value for key, value in sentinel_options.items()
                                          if key != "sentinels"},
        broker_transport_options={
            **sentinel_options,
            "priority_steps": sorted(PRIORITY_LEVELS.values()),
            "sep": ":",
            "queue_order_strategy": "priority",
            # A session runs for seconds to minutes; redelivery after a dead
            # worker comes from this timeout, and a lease keeps it single-owner.
            "visibility_timeout": 300,
        },
        result_expires=3600,
        include=["draft_worker.tasks"],
    )
    return app
