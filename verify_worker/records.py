"""The SQL record of the sessions this verify worker drives itself (placement local), written off the loop.

A draft worker records its sessions (draft_worker/runtime.py); a verify worker that drafts for its own does
the same, from a thread of its own, so a slow database never holds up a step.
"""

from __future__ import annotations

import logging
import queue
import threading
from datetime import datetime, timezone

from services.engine.draft_session import DraftSession
from services.storage import crud

logger = logging.getLogger(__name__)


def _utc(timestamp: float | None) -> datetime | None:
    return datetime.fromtimestamp(timestamp, timezone.utc) if timestamp else None


class Recorder(threading.Thread):
    def __init__(self, db) -> None:
        super().__init__(daemon=True, name="sql-records")
        self.db = db
        self._queue: queue.Queue[tuple[str, dict] | None] = queue.Queue()

    def started(self, request_id: str) -> None:
        self._queue.put((request_id, {"status": "running", "started_at": datetime.now(timezone.utc)}))

    def ended(self, session: DraftSession, num_output_tokens: int, *, error: str | None = None) -> None:
        """num_output_tokens: the output the stream carries (the client's `completion_tokens`: no EOS, nothing
        committed past a stop), not the tokens the target committed."""
        summary = session.summary()
        status = "failed" if error else crud.ended_status(summary.finish_reason)
        self._queue.put((session.request_id, {
            "status": status, "finish_reason": "error" if error else summary.finish_reason, "error": error,
            "completion_tokens": num_output_tokens, **summary.stats.row_counters(),
            "plain_reason": summary.plain_reason,
            "first_token_at": _utc(summary.first_token_at), "finished_at": datetime.now(timezone.utc),
            "recorded_by": crud.RECORDED_BY_DRIVER}))

    def close(self) -> None:
        self._queue.put(None)

    def run(self) -> None:
        while (item := self._queue.get()) is not None:
            request_id, fields = item
            try:
                with self.db() as session:
                    crud.record_work(session=session, request_id=request_id, **fields)
            except Exception:  # SQL is the record, not the answer: never fail a session over it
                logger.exception("could not record request %s", request_id, extra={"request_id": request_id})
