"""kombu's Redis transport, made to ride out a broker outage (the Celery app's `broker_transport`).

When Redis goes away while session tasks run (they are acknowledged late, at
their end), kombu's stock transport tries to put the unacknowledged messages
back on the queue through the connection that just died, raises an
AttributeError that Celery calls unrecoverable, and the worker stops
consuming for good. Here the restore and the acknowledgements are best
effort: what cannot be done now stays in kombu's unacknowledged index, and
kombu's own visibility-timeout restore redelivers it later, where the task
finds its session finished (or resumes it). Celery then reconnects as usual.
"""

from __future__ import annotations

import logging

import redis
from kombu.transport import redis as kombu_redis

logger = logging.getLogger(__name__)

_GONE = (AttributeError, redis.RedisError, OSError)  # AttributeError: the channel's connection is already None


class QoS(kombu_redis.QoS):
    def restore_unacked(self, client=None):
        try:
            return super().restore_unacked(client)
        except _GONE as exc:
            logger.warning("broker unreachable (%s): %d unacknowledged task(s) stay indexed and are redelivered "
                           "after the visibility timeout unless they finish first", type(exc).__name__,
                           len(self._delivered))
            self._delivered.clear()
            return None

    def ack(self, delivery_tag):
        try:
            super().ack(delivery_tag)
        except _GONE as exc:
            logger.warning("could not acknowledge task %s (%s): it is redelivered after the visibility timeout and "
                           "then finds its session finished", delivery_tag, type(exc).__name__)
            self._delivered.pop(delivery_tag, None)

    def reject(self, delivery_tag, requeue=False):
        try:
            super().reject(delivery_tag, requeue=requeue)
        except _GONE as exc:
            logger.warning("could not reject task %s (%s)", delivery_tag, type(exc).__name__)
            self._delivered.pop(delivery_tag, None)


class Channel(kombu_redis.Channel):
    QoS = QoS


class Transport(kombu_redis.Transport):
    Channel = Channel


TRANSPORT = f"{__name__}:Transport"
