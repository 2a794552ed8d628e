"""The fleet's history for suffix drafts, through Redis: finished outputs appended to one capped stream
(HISTORY_STREAM_KEY) by whoever committed their last round, and tailed by every drafting process into its
per-tenant suffix indexes (services/models/drafters/history.py).

Cost: one XADD per finished request (its prompt's last tokens and its output ids, msgpack), never per round; the
stream keeps the last HISTORY_STREAM_MAX outputs, so Redis holds a bounded amount. A reader that starts (or comes
back after Redis failed over) reads the kept outputs first, oldest first, then follows. Best effort: with Redis
away a draft drafts from what its indexes hold, and an output not appended is only a draft not made.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from services.models.drafters.history import History
from services.protocol import HISTORY_STREAM_KEY, HISTORY_STREAM_MAX, FinishedOutput, ProtocolError

logger = logging.getLogger(__name__)

BLOCK_MS = 1000
RETRY_S = 1.0
FIELD = b"m"
HISTORY_PROMPT_TAIL = 16  # prompt tokens kept before an output: the chat template's last ones, so an opening matches


def append_finished(client: redis.Redis, output: FinishedOutput) -> None:
    """Append one finished output (a pipeline is fine: the caller executes it)."""
    client.xadd(HISTORY_STREAM_KEY, {FIELD: output.encode()}, maxlen=HISTORY_STREAM_MAX, approximate=True)


def apply_entry(history: History, fields: dict[bytes, bytes]) -> bool:
    """One stream entry into the history; False for an entry that does not decode (skipped, logged)."""
    try:
        output = FinishedOutput.decode(fields[FIELD])
    except (KeyError, ProtocolError) as exc:
        logger.warning("suffix history: an entry that does not decode was skipped (%s)", exc)
        return False
    history.add(output.tenant, output.prompt_tail, output.output_ids)
    return True


class HistoryFeed:
    """Follows the stream into a History on a daemon thread of its own, for the life of the process."""

    def __init__(self, client: redis.Redis, history: History) -> None:
        self.client = client
        self.history = history
        self.last_id: bytes | str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> "HistoryFeed":
        self._thread = threading.Thread(target=self._run, name="suffix-history", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def read_once(self, block_ms: int | None = BLOCK_MS) -> int:
        """Read what is new (the kept outputs first on the first call); returns the entries applied."""
        applied = 0
        if self.last_id is None:
            entries = self.client.xrange(HISTORY_STREAM_KEY, "-", "+")
            for entry_id, fields in entries:
                applied += apply_entry(self.history, fields)
            self.last_id = entries[-1][0] if entries else "0-0"
            return applied
        response = self.client.xread({HISTORY_STREAM_KEY: self.last_id}, block=block_ms)
        for _, entries in response or []:
            for entry_id, fields in entries:
                self.last_id = entry_id
                applied += apply_entry(self.history, fields)
        return applied

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.read_once()
            except (redis.RedisError, OSError) as exc:
                # the last id read stays: entries after it are read next (a failed-over Redis's included)
                logger.warning("suffix history: cannot read the stream (%s); again in %.0fs", exc, RETRY_S)
                time.sleep(RETRY_S)


def history_figures(source) -> dict[str, int]:
    """A draft source's history figures for its heartbeat ({} where it keeps none)."""
    return source.history.figures() if source.history is not None else {}


def follow_history(source, redis_url: str) -> HistoryFeed | None:
    """Start feeding a draft source's history from the fleet's stream (None when it keeps none)."""
    from services.redis_conn import connect

    history = source.shared_history()
    if history is None:
        return None
    return HistoryFeed(connect(redis_url, socket_timeout=BLOCK_MS / 1000 + 5), history).start()
