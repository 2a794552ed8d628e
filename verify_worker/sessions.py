"""Per-request state on a verify worker: a session, its bridge, and its rebuild from the stream (the table that
holds them and bounds their KV memory is in session_table.py).

A session is the round's TargetSession (services/engine/target.py) plus what
the worker needs around it: the request spec, the block it is working on,
how many target-only rounds of that block are left, and when it last
answered (to know whose next block is on its way).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from services.engine.draft_session import DraftSession
from services.engine.stopping import OutputState
from services.engine.target import TargetSession
from services.models.engine import TargetEngine
from services.link.meter import smoothed
from services.protocol import DraftBlock, OutputEvent, SessionSpec, Verdict, decode_probs
from services.speculative.bridging import bridges, fast_forward
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
    batch_rows: int = 1  # rows its verdict tells: the step's that verified the drafted round, and openings on their way
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
    # Bridging (services/speculative/bridging.py): whether the session may, and (round, committed tokens) where
    # its bridge began (None: not bridging); each bridged round commits one token
    may_bridge: bool = False
    # draft_prefill "after_opening": its draft prefills after the opening's verdict, not during it (the opening does
    # not keep the draft busy), and the session bridges (where it may) from that verdict to its first drafted block
    draft_after_opening: bool = False
    bridge_from: tuple[int, int] | None = None
    num_bridged: int = 0  # rounds bridged before the block in hand (its verdict says so)
    # seconds from a verdict to the next block's arrival, smoothed, after a block accepted whole (its chained
    # successor is likely on its way) and after any other verdict (the draft drafts again from it)
    gaps: dict[bool, float] = field(default_factory=dict)
    # it has taken a block after its opening (a resumed one: its block): its draft's start (hearing of the request,
    # prefilling, catching up on the opening's bridge) is behind it; the load word measures no step before that
    opened: bool = False

    @property
    def request_id(self) -> str:
        return self.spec.request_id

    @property
    def round(self) -> int:
        """Rounds committed so far = the next round's number = output events in the stream."""
        return self.target.round_index

    @property
    def has_work(self) -> bool:
        """A block in hand, or a bridge: the next step has a row for it."""
        return (self.block is not None or self.bridge_from is not None) and not self.target.finished

    @property
    def bridging(self) -> bool:
        """Between a verdict and the next block, running target-only rounds of its own."""
        return self.block is None and self.bridge_from is not None and not self.target.finished

    @property
    def active(self) -> bool:
        """Holds a block, or drafts its next one here (a local session between rounds is never idle)."""
        return self.has_work or (self.local is not None and not self.target.finished)

    @property
    def told_plain(self) -> bool:
        """Its last verdict carried this worker's word "plain" (verify_worker/load_word.py), which its draft takes:
        until its next block comes, the draft drafts nothing (that block is target-only rounds)."""
        return self.block is None and self.last_verdict is not None and self.last_verdict.load_arm == "plain" \
            and self.spec.sampling.layout_free

    def opens_told_plain(self, last_word: str) -> bool:
        """Holds its opening round (round 0, target-only) while the word on the last verdict this worker sent was
        "plain" (last_word): its draft worker most likely heard it last, and a new session's draft starts from
        the last word heard (neither speculating nor prefilling). A guess: wrong, a step runs wide beside a
        draft that prefills, until the opening's verdict."""
        block = self.block
        return last_word == "plain" and block is not None and block.round == 0 and not block.draft_ids \
            and self.spec.sampling.layout_free

    @property
    def drafts_now(self) -> bool:
        """A remote speculative session whose draft may be drafting for it: any but one holding target-only
        rounds after round 0 (rounds the load or a fallback asked for: its draft waits for their verdict) or
        waiting for the block its last verdict told to be target-only rounds."""
        return self.keeps_a_draft_busy or (self._remote_speculative and self.block is not None
                                           and self.block.round == 0)

    @property
    def keeps_a_draft_busy(self) -> bool:
        """A draft worker drafts for it now, or will at its next verdict: a remote speculative session, unless the
        block in hand is target-only rounds after round 0 (the draft waits for their verdict; it speculates only
        during an opening round). A bridging session's draft is drafting its next block."""
        if not self._remote_speculative:
            return False
        block = self.block
        return block is None or bool(block.draft_ids) or (block.round == 0 and not self.draft_after_opening)

    @property
    def drafted_remotely(self) -> bool:
        """A running speculative session whose draft is a draft worker's (not this worker's own: placement local)."""
        return self.local is None and self.spec.route == "sd" and not self.target.finished

    @property
    def _remote_speculative(self) -> bool:
        """Drafted remotely, and not waiting on target-only rounds it was told to send."""
        return self.drafted_remotely and not self.told_plain

    @property
    def awaits_draft_call(self) -> bool:
        """Waiting for the block after target-only rounds (its opening, or rounds the load asked for): whether
        the draft drafts that block is its call at this load (verify_worker/draft_word.py)."""
        last = self.last_block
        return self.block is None and last is not None and not last.draft_ids

    @property
    def autonomous(self) -> bool:
        """Running target-only rounds on its own: the rest of its block's, or a bridge's."""
        return self.has_work and (self.first_round_done or self.block is None)

    def take(self, block: DraftBlock, *, first_round_done: bool = False,
             base_stats: SpecDecodingStats | None = None) -> None:
        """Work on `block` (whose first round may already be committed: a block resumed elsewhere)."""
        self._hold(block, first_round_done, base_stats, num_bridged=0)
        self.block_end_round = block.round + max(1, block.num_rounds)
        if not first_round_done:
            self.target.set_draft(block.draft_ids, decode_probs(block), block.drafter)

    def _hold(self, block: DraftBlock, first_round_done: bool, base_stats: SpecDecodingStats | None,
              num_bridged: int) -> None:
        self.block = block
        self.opened = self.opened or block.round > 0
        self.bridge_from = None
        self.num_bridged = num_bridged
        self.first_round_done = first_round_done
        self.block_stats = (base_stats or self.target.stats).copy()
        self.block_started_at = time.time()  # taken: time from here to the verdict is the worker's
        self.arrived_at = time.monotonic()

    @property
    def _whole(self) -> bool:
        verdict, block = self.last_verdict, self.last_block
        return bool(verdict and block and block.draft_ids and verdict.num_accepted == len(block.draft_ids))

    def note_arrival(self) -> None:
        """A block came while the session waited (or bridged) after its last verdict: the gap, for bridge_wait."""
        if self.block is None and self.last_verdict is not None:
            self.gaps[self._whole] = smoothed(self.gaps.get(self._whole), time.monotonic() - self.last_verdict_at,
                                              weight=0.3)

    def bridge_wait(self, step_s: float, now: float | None = None) -> float:
        """Seconds until a bridged round should start (0: now). A round started just before the block comes
        would hold the block up for a whole step, so none starts when the block is due within a step; a block
        late by twice its usual gap is not counted on any more. No gap measured yet: now."""
        gap = self.gaps.get(self._whole)
        if gap is None or self.spec.route == "ar":  # a plain block only takes over the rounds bridged: no wait
            return 0.0
        elapsed = (time.monotonic() if now is None else now) - self.last_verdict_at
        if elapsed + step_s <= gap or elapsed >= 2 * gap:
            return 0.0
        return 2 * gap - elapsed

    def bridged_since(self, block: DraftBlock) -> int | None:
        """Rounds bridged after the point `block` was drafted from, when that point is on this bridge (its
        round and committed tokens moved together, one token a round); None when it is not."""
        if not self.bridging:
            return None
        first_round, first_committed = self.bridge_from
        offset = block.round - first_round
        if offset < 0 or block.round > self.round or block.num_committed - first_committed != offset:
            return None
        return self.round - block.round

    def take_bridged(self, block: DraftBlock, num_bridged: int) -> bool:
        """Work on `block`, drafted `num_bridged` bridged rounds ago: its first tokens are checked against
        theirs (services/speculative/bridging.py), the rest is verified from here. False when nothing is left
        to verify: the block is done (block_done()) and its verdict due at once."""
        bridged_ids = self.target.token_ids[block.num_committed:]
        assert len(bridged_ids) == num_bridged, "a bridged round commits one token"
        base_stats = self.target.stats.copy()
        drafted = bool(block.draft_ids)
        if not drafted:  # target-only rounds asked for: the bridged ones count as theirs
            self._hold(block, True, base_stats, num_bridged=0)
            self.block_end_round = block.round + max(1, block.num_rounds)
            return not self.block_done()
        outcome = fast_forward(block.draft_ids, bridged_ids)
        self.target.stats.observe_checked(outcome.num_checked, outcome.num_matched, ends_draft=not outcome.rest,
                                          drafter=block.drafter)
        self._hold(block, not outcome.rest, base_stats, num_bridged=num_bridged)
        if not outcome.rest:
            self.block_end_round = self.round
            return False
        self.block_end_round = self.round + max(1, block.num_rounds)
        probs = decode_probs(block)
        skip = outcome.num_matched
        self.target.set_draft(block.draft_ids[skip:], probs[skip:] if probs is not None else None, block.drafter)
        return True

    def block_done(self) -> bool:
        return self.target.finished or self.round >= self.block_end_round

    def expects(self, block: DraftBlock) -> bool:
        """A chained block whose parent is in hand or parked here: it waits for its parent's verdict."""
        if self.block is None or self.target.finished:
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

    def answered(self, verdict: Verdict, *, behind_bridge: bool = False) -> None:
        """The block in hand is done and `verdict` says what it committed; a session that may bridges until
        the next block comes, and so does one whose draft prefills only now (after its opening), and one whose
        block was target-only rounds after its opening (its draft drafted nothing meanwhile: it hears the verdict
        over its link, and its next block, target-only rounds again or drafted from that verdict, crosses back;
        bridging fills that wait, where the bridge keeps its output: greedy or unseeded). behind_bridge: the block
        was answered at once, the bridge having gone past it or away from it (take_bridged): the bridge goes on,
        for the next block is a whole trip and its drafting away, and every round bridged meanwhile is a token the
        block, checked against it, could at best have matched."""
        plain = self.block is not None and not self.block.draft_ids
        opening = plain and self.block.round == 0
        self.last_block, self.last_verdict = self.block, verdict
        self.block = None
        self.num_bridged = 0
        self.last_verdict_at = time.monotonic()
        after_plain = (behind_bridge or plain and (self.draft_after_opening or not opening)) \
            and bridges(self.spec.sampling, self.spec.route)
        if (self.may_bridge or after_plain) and not verdict.finished and self.local is None:
            self.bridge_from = (self.round, self.target.num_committed)


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
