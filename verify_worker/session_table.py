"""The verify worker's sessions, least recently used first, and the KV of finished ones kept for prefix reuse
(the memory bound: LRU over idle sessions)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from services.config import MergingSettings
from services.engine.prefix_cache import PrefixSource, RetiredPrefixes, best_prefix
from services.engine.target import TargetSession
from services.models.engine import TargetEngine
from verify_worker.sessions import VerifySession

logger = logging.getLogger(__name__)


@dataclass
class PrefixCounters:
    """Cumulative prefix-reuse figures of a worker (its heartbeat carries them to /metrics)."""

    lookups: int = 0  # sessions started (new or rebuilt) with reuse on
    hits: int = 0  # of those, started from another sequence's prefix
    reused_tokens: int = 0  # positions copied instead of prefilled
    retired: int = 0  # finished sessions' sequences kept now
    retired_bytes: int = 0


class SessionTable:
    """The worker's sessions, least recently used first, and the KV of finished ones kept for prefix reuse;
    while the KV store is over budget, retired sequences go first, then idle sessions.

    An evicted session is rebuilt from its committed prefix on its next block."""

    def __init__(self, engine: TargetEngine, merging: MergingSettings | None = None) -> None:
        self.engine = engine
        self.merging = merging or MergingSettings()
        self._sessions: OrderedDict[str, VerifySession] = OrderedDict()
        self.retired = RetiredPrefixes(self.merging.retired_sessions if self.merging.prefix_reuse else 0)
        self.prefix = PrefixCounters()
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._sessions

    def __iter__(self) -> Iterator[VerifySession]:
        return iter(list(self._sessions.values()))

    @property
    def kv_bytes(self) -> int:
        return self.engine.store.used_bytes

    def get(self, request_id: str) -> VerifySession | None:
        return self._sessions.get(request_id)

    def touch(self, session: VerifySession) -> None:
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session.request_id)

    def put(self, session: VerifySession) -> None:
        self.pop(session.request_id)
        self._sessions[session.request_id] = session

    def pop(self, request_id: str, *, retire: bool = False) -> VerifySession | None:
        """Forget a session; retire=True keeps its KV for prefix reuse (it finished or was cancelled: what it
        holds is valid), else the memory goes back to the store."""
        session = self._sessions.pop(request_id, None)
        if session is not None:
            if session.local is not None:
                session.local.release()  # the draft's KV of this session
            target = session.target
            if retire and target.sequence.length >= self.merging.min_prefix_tokens:
                self.retired.retire(request_id, target.token_ids, target.sequence, salt=session.spec.cache_salt)
            else:
                target.release()
        return session

    def _prefix_sources(self) -> Iterator[PrefixSource]:
        for session in self._sessions.values():
            yield PrefixSource(session.request_id, session.target.token_ids, session.target.sequence, retired=False,
                               salt=session.spec.cache_salt)
        yield from self.retired

    def reuse_prefix(self, target: TargetSession, salt: str | None = None) -> int:
        """Start a new session's empty KV from the longest common prefix a live or retired sequence holds (a
        copy: nothing stays shared); the positions reused, 0 when none is long enough or the copy does not
        fit the budget (the prompt is then prefilled as usual)."""
        if not self.merging.prefix_reuse or target.sequence.length:
            return 0
        self.prefix.lookups += 1
        match = best_prefix(target.token_ids, self._prefix_sources(), min_tokens=self.merging.min_prefix_tokens,
                            salt=salt)
        if match is None:
            return 0
        store = self.engine.store
        needed = store.growth_bytes(target.sequence, match.length)
        if not self.evict_idle(needed, keep={match.source.key}):
            return 0
        target.sequence.copy_prefix(match.source.sequence, match.length)
        self.retired.touch(match.source.key)
        self.prefix.hits += 1
        self.prefix.reused_tokens += match.length
        logger.info("prefix reuse: %d of %d tokens from %s%s", match.length, target.num_committed, match.source.key,
                    " (finished)" if match.source.retired else "")
        return match.length

    def prefix_figures(self) -> dict:
        self.prefix.retired = len(self.retired)
        self.prefix.retired_bytes = sum(source.sequence.reserved_bytes for source in self.retired)
        return asdict(self.prefix)

    def drop_idle(self, idle_s: float) -> None:
        """Drop sessions that have waited idle_s for a block: whoever drove them is gone (a rebuild from the
        stream serves them if a block ever comes)."""
        deadline = time.monotonic() - idle_s
        for session in list(self._sessions.values()):
            if session.last_used >= deadline:
                break  # least recently used first: the rest are younger
            if not session.active:
                logger.info("dropped session %s: no block for %.0f s", session.request_id, idle_s,
                            extra={"request_id": session.request_id})
                self.pop(session.request_id)

    def evict_idle(self, needed_bytes: int = 0, *, keep: set[str] = frozenset()) -> bool:
        """Evict retired sequences, then idle sessions (no block in hand), least recently used first, until
        `needed_bytes` more fit the budget; True when they do."""
        store = self.engine.store
        while store.over_budget(needed_bytes) and self.retired.evict_one(keep=keep):
            pass
        for session in list(self._sessions.values()):
            if not store.over_budget(needed_bytes):
                break
            if session.active or session.request_id in keep or session.target.sequence.capacity == 0:
                continue
            self.pop(session.request_id)
            self.num_evictions += 1
            logger.info("evicted session %s (KV budget %d bytes)", session.request_id, store.budget_bytes,
                        extra={"request_id": session.request_id})
        return not store.over_budget(needed_bytes)
