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
from redis import sentinel

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


class SentinelChannel(kombu_redis.SentinelChannel):
    """kombu reads the sentinels from a broker URL's ';'-separated alternates, and on a connection error
    also cycles through those alternates, re-creating the connection with its stock transport (whose QoS
    then stops the worker at the next outage). So kombu gets one URL, and every sentinel comes here as the
    `sentinels` transport option (services/redis_url.py, celery_broker)."""

    QoS = QoS
    from_transport_options = kombu_redis.SentinelChannel.from_transport_options + ("sentinels",)
    sentinels: list | None = None

    def _sentinel_managed_pool(self, asynchronous=False):
        if not self.sentinels:
            return super()._sentinel_managed_pool(asynchronous)
        params = self._connparams(asynchronous)
        params.pop("host", None)
        params.pop("port", None)
        manager = sentinel.Sentinel([tuple(address) for address in self.sentinels],
                                    min_other_sentinels=getattr(self, "min_other_sentinels", 0),
                                    sentinel_kwargs=getattr(self, "sentinel_kwargs", None), **params)
        if asynchronous:  # kept so that kombu closes its connections to the sentinels with the channel
            self._async_sentinel_manager = manager
        else:
            self._sentinel_manager = manager
        auth = {key: params[key] for key in ("username", "password") if key in params}
        return manager.master_for(self.master_name, redis.Redis, **auth).connection_pool


class SentinelTransport(kombu_redis.SentinelTransport):
    """The same, for a primary found through Sentinel (a `redis+sentinel://` redis_url)."""
    Channel = SentinelChannel


TRANSPORT = f"{__name__}:Transport"
SENTINEL_TRANSPORT = f"{__name__}:SentinelTransport"
