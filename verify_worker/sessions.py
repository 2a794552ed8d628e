"""Per-request state on a verify worker, and the table that bounds their KV memory (LRU over idle sessions).
(Just over 300 lines: a session, its rebuild from the stream and the table that holds them.)

A session is the round's TargetSession (services/engine/target.py) plus what
the worker needs around it: the request spec, the block it is working on,
how many target-only rounds of that block are left, and when it last
answered (to know whose next block is on its way).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from services.config import MergingSettings
from services.engine.draft_session import DraftSession
from services.engine.prefix_cache import PrefixSource, RetiredPrefixes, best_prefix
from services.engine.stopping import OutputState
from services.engine.target import TargetSession
from services.models.engine import TargetEngine
from services.protocol import DraftBlock, OutputEvent, SessionSpec, Verdict, decode_probs
from services.speculative.chaining import chain_holds
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)


@dataclass
class VerifySession:
    spec: SessionSpec
    target: TargetSession
    block: DraftBlock | None = None  # the block being worked on
    first_round_done: bool = False  # its drafted round is verified; target-only rounds may remain
    block_end_round: int = 0  # the round after the block's last
    block_stats: SpecDecodingStats = field(default_factory=SpecDecodingStats)  # stats when the block began
    batch_rows: int = 1  # rows of the step that verified the block's drafted round
    block_started_at: float = 0.0  # wall clock: when the worker took the block
    arrived_at: float = 0.0  # monotonic, the same moment: first come, first served within a priority
    last_verdict_at: float = 0.0  # monotonic: when its last verdict went out (its next block is coming)
    last_used: float = field(default_factory=time.monotonic)
    num_cached_tokens: int = 0  # prompt tokens whose KV came from another sequence when the request started
    local: DraftSession | None = None  # placement local: its draft half, drafted by this worker between steps
    # Blocks verified ahead (services/speculative/chaining.py): chained blocks that came while their parent was
    # in hand, and the verdict of the last block done here (a chained block arriving after it is checked on it)
    parked: list[DraftBlock] = field(default_factory=list)
    last_block: DraftBlock | None = None
    last_verdict: Verdict | None = None

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def round(self) -> int:
        """Rounds committed so far = the next round's number = output events in the stream."""
        return self.target.round_index

    @property
    def has_work(self) -> bool:
        return self.block is not None and not self.target.finished

    @property
    def active(self) -> bool:
        """Holds a block, or drafts its next one here (a local session between rounds is never idle)."""
        return self.has_work or (self.local is not None and not self.target.finished)

    @property
    def autonomous(self) -> bool:
        """Running target-only rounds of its block on its own (no block awaited between them)."""
        return self.has_work and self.first_round_done

    def take(self, block: DraftBlock, *, first_round_done: bool = False,
             base_stats: SpecDecodingStats | None = None) -> None:
        """Work on `block` (whose first round may already be committed: a block resumed elsewhere)."""
        self.block = block
        self.first_round_done = first_round_done
        self.block_end_round = block.round + max(1, block.num_rounds)
        self.block_stats = (base_stats or self.target.stats).copy()
        self.block_started_at = time.time()  # taken: time from here to the verdict is the worker's
        self.arrived_at = time.monotonic()
        if not first_round_done:
            self.target.set_draft(block.draft_ids, decode_probs(block))

    def block_done(self) -> bool:
        return self.target.finished or self.round >= self.block_end_round

    def expects(self, block: DraftBlock) -> bool:
        """A chained block whose parent is in hand or parked here: it waits for its parent's verdict."""
        if not self.has_work:
            return False
        return block.parent_id in (self.block.block_id, *(parked.block_id for parked in self.parked))

    def next_in_chain(self) -> DraftBlock | None:
        """After a block's verdict (last_block, last_verdict): its parked child when the child's assumption
        held (the rest of the chain stays parked behind it), else None and the whole chain is dropped (its
        sender sees the same verdict and drafts again from it)."""
        parked, self.parked = self.parked, []
        parent, verdict = self.last_block, self.last_verdict
        if parent is None or verdict is None or self.target.finished:
            return None
        child = next((block for block in parked if block.parent_id == parent.block_id), None)
        if child is None or not chain_holds(verdict, parent, child):
            return None
        self.parked = [block for block in parked if block is not child]
        return child

    def answered(self, verdict: Verdict) -> None:
        """The block in hand is done and `verdict` says what it committed."""
        self.last_block, self.last_verdict = self.block, verdict
        self.block = None
        self.last_verdict_at = time.monotonic()


Reuse = Callable[[TargetSession, str | None], int]  # a new session's KV from a common prefix of the same salt


def build_session(engine: TargetEngine, spec: SessionSpec, events: list[OutputEvent],
                  reuse: Reuse | None = None) -> VerifySession:
    """A session from the request spec and the committed output so far (a new one, or a rebuild). Nothing
    is computed here but a prefix copy (`reuse`): the engine prefills what the KV lacks in the next steps, in
    chunks."""
    output_ids = [token_id for event in events for token_id in event.token_ids]
    target = engine.target
    output = OutputState.for_request(target, max_new_tokens=spec.max_new_tokens, stop=spec.stop,
                                     ignore_eos=spec.ignore_eos, output_ids=output_ids)
    sampling = spec.sampling
    stats = events[-1].stats.copy() if events else SpecDecodingStats()
    session = TargetSession(engine, spec.prompt_ids, output=output, sampling=sampling, stats=stats,
                            round_index=len(events))
    reused = reuse(session, spec.cache_salt) if reuse is not None else 0
    return VerifySession(spec=spec, target=session,
                         num_cached_tokens=events[-1].num_cached_tokens if events else reused)


def resume_block(engine: TargetEngine, spec: SessionSpec, events: list[OutputEvent],
                 block: DraftBlock, reuse: Reuse | None = None) -> "VerifySession | Verdict | None":
    """A block whose session this worker does not hold in its state, against the request's stream:
    - its rounds are all committed (a redelivered task, a resend after a failover): a resync verdict;
    - none is: a session built from the committed prefix, taking the block;
    - some are (target-only rounds a dead worker began): a session that takes the rest of them;
    - the block is from a future the stream does not know, or saw another prefix: None (dropped)."""
    end_round = block.round + max(1, block.num_rounds)
    if len(events) < block.round:
        logger.warning("request %s: block for round %d, stream has %d events: dropped", block.request_id,
                       block.round, len(events), extra={"request_id": block.request_id})
        return None
    if len(events) >= end_round or (events and events[-1].finished):
        return resync_verdict(block, events)
    session = build_session(engine, spec, events, reuse)
    resumed = len(events) > block.round
    if not resumed and session.target.num_committed != block.num_committed:
        logger.warning("request %s: block saw %d tokens, stream holds %d: dropped", block.request_id,
                       block.num_committed, session.target.num_committed, extra={"request_id": block.request_id})
        session.target.release()
        return None
    session.take(block, first_round_done=resumed,
                 base_stats=events[block.round - 1].stats if block.round > 0 else None)
    return session


def resync_verdict(block: DraftBlock, events: list[OutputEvent]) -> Verdict:
    """A verdict for a block whose rounds the stream already holds: what they committed, from the stream."""
    done = events[block.round:]
    last = events[-1] if events else None
    stats = last.stats if last is not None else SpecDecodingStats()
    before = events[block.round - 1].stats if block.round > 0 else SpecDecodingStats()
    num_draft_tokens, num_accepted = stats.minus(before)
    committed = [token for event in done for token in event.token_ids]
    return Verdict(
        request_id=block.request_id, round=block.round, num_committed=block.num_committed + len(committed),
        num_draft_tokens=num_draft_tokens, num_accepted=num_accepted, committed_ids=committed,
        finished=bool(last and last.finished), finish_reason=last.finish_reason if last else None,
        worker_id="", num_rounds=len(done), stats=stats, block_sent_at=block.sent_at, block_id=block.block_id,
    )


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
