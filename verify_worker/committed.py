"""The last events this worker committed to each request's stream, to make a stream whole again.

Redis replicates asynchronously: when a primary dies, the replica that takes over may lack its last writes,
and a pipeline cut by the failure may have carried some too. Either way the stream holds fewer events than
the worker committed. The worker then appends the missing ones again: the same events with the same
sequence numbers, so a reader takes each token once (gateway/streams/reader.py, OutputCursor). Finished
requests are kept a while too: the last event of a request may be the one lost.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field

KEEP_EVENTS = 32  # per request: a failover loses well under a second of writes
KEEP_FINISHED_S = 120.0
KEEP_FINISHED_MAX = 4096  # requests: a bound on memory whatever the request rate


@dataclass
class CommittedEvents:
    events: dict[str, deque[tuple[int, bytes]]] = field(default_factory=dict)
    finished: OrderedDict[str, float] = field(default_factory=OrderedDict)  # request -> monotonic time

    def record(self, request_id: str, seq: int, event: bytes) -> None:
        """An event about to be committed at `seq` (recorded first: a commit whose reply is lost counts)."""
        ring = self.events.setdefault(request_id, deque(maxlen=KEEP_EVENTS))
        while ring and ring[-1][0] >= seq:  # a round committed again (a rebuilt session): the newest wins
            ring.pop()
        ring.append((seq, event))

    def finish(self, request_id: str, now: float) -> None:
        if request_id in self.events:
            self.finished[request_id] = now
            self.finished.move_to_end(request_id)

    def forget(self, request_id: str) -> None:
        self.events.pop(request_id, None)
        self.finished.pop(request_id, None)

    def expire(self, now: float, live: set[str] | None = None) -> None:
        """Forget requests finished KEEP_FINISHED_S ago; with `live`, a request no longer held (dropped:
        cancelled, idle, taken over) counts as finished now."""
        if live is not None:
            for request_id in self.events:
                if request_id not in live and request_id not in self.finished:
                    self.finished[request_id] = now
        while self.finished:
            request_id, at = next(iter(self.finished.items()))
            if now - at < KEEP_FINISHED_S and len(self.finished) <= KEEP_FINISHED_MAX:
                break
            self.forget(request_id)

    def tracked(self) -> list[str]:
        return list(self.events)

    def missing(self, request_id: str, have: int) -> list[tuple[int, bytes]] | None:
        """The recorded events at `have` and after, in order; None when the record does not reach back to
        `have` (the stream lost more than is kept here: the request cannot be made whole)."""
        ring = self.events.get(request_id)
        if not ring or ring[-1][0] < have:
            return []
        if ring[0][0] > have:
            return None
        return [(seq, event) for seq, event in ring if seq >= have]
