"""Count a generation's work once per gateway, however many clients read its output stream.

With single-flight several readers in one gateway read the same stream. Tokens/s counts an event's
tokens when the first of them reads it, so a leader whose client left early hands the counting to the
readers still there. The generation's speculative-decoding stats (cumulative in its last event) are
claimed once: by the first reader that saw it end, or that ended it as its last subscriber; with several
gateways, by the first of them too (claim_across_gateways). Tokens/s stays per gateway: each counts what its
own clients read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import redis

from services.protocol import work_counted_key
from services.redis_client import REQUEST_TTL_S

logger = logging.getLogger(__name__)


@dataclass
class _StreamCount:
    num_readers: int = 0
    last_seq: int = -1  # events up to this seq are counted
    end_claimed: bool = False


class StreamShare:
    """One reader's handle on a stream's count."""

    def __init__(self, count: _StreamCount) -> None:
        self._count = count

    def first_sight(self, seq: int) -> bool:
        """True for the first reader here to read event `seq` (events come in seq order to every reader)."""
        if seq <= self._count.last_seq:
            return False
        self._count.last_seq = seq
        return True

    def claim_end(self) -> bool:
        """True once per stream: this reader counts the generation's stats."""
        if self._count.end_claimed:
            return False
        self._count.end_claimed = True
        return True


class StreamTally:
    """Per gateway process: stream name -> what its readers here have counted, while any of them reads."""

    def __init__(self) -> None:
        self._streams: dict[str, _StreamCount] = {}

    @contextmanager
    def reading(self, stream: str) -> Iterator[StreamShare]:
        count = self._streams.setdefault(stream, _StreamCount())
        count.num_readers += 1
        try:
            yield StreamShare(count)
        finally:
            count.num_readers -= 1
            if count.num_readers == 0:
                del self._streams[stream]

    def __len__(self) -> int:
        return len(self._streams)


async def claim_across_gateways(client, request_id: str) -> bool:
    """True for the one gateway that counts the generation `request_id`'s stats (a SET NX); True too when Redis
    cannot tell (counted twice rather than never)."""
    try:
        return bool(await client.set(work_counted_key(request_id), b"1", nx=True, ex=REQUEST_TTL_S))
    except (redis.RedisError, OSError) as exc:
        logger.warning("request %s: counting its stats here, Redis could not say who does (%s)", request_id, exc)
        return True

