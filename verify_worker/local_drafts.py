"""Co-located drafting (placement "local"): this verify worker drafts for its own sessions, in-process.

On one box a draft worker of its own would take cores from the target and put a Redis round trip in every
round. Here the draft runs in the verify worker between its forwards, on all its cores: every turn, each
local session that needs a block gets it from its DraftSession (services/engine/draft_session.py, the same
draft half a remote draft worker runs), the drafting of all of them in one batched call; the step verifies
those blocks with every other session's rows; each verdict goes back to its DraftSession in-process. Per
round only the output events cross Redis, as for any session.

A session arrives as a start block (DraftBlock.draft_here) on the pool's queue. The worker that takes it
becomes its owner (the owner key, which the gateway's recovery reads: a dead owner's sessions are started
again on another worker of the pool, from their committed output) and records its outcome in SQL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from services.config import SpeculativeSettings
from services.engine.draft_session import DraftSession
from services.models.drafters.batched import engine_drafter, propose_many
from services.models.drafters.factory import DraftSource
from services.models.drafters.target_kv import link_target
from services.protocol import DraftFallback, OutputEvent, Verdict
from services.speculative.block_length import RecentRounds
from services.speculative.cost_model import CostModel, best_block_length
from services.speculative.measured_turns import DRAFT, PLAIN, DraftPrefillCost, MeasuredTurns, load_bucket
from verify_worker.sessions import VerifySession

logger = logging.getLogger(__name__)

# Target-only rounds per block of a local session: a block costs no round trip here, so every turn decides
# again, at its load, whether to draft (a remote block asks for up to 64, to spare the Redis round trips).
LOCAL_PLAIN_ROUNDS = 1
# Draft KV a turn catches up at most, over all sessions that lag (a new session's prompt, the tokens that plain
# turns committed): one prefill forward of the draft, so that no turn holds every row up for a long catch-up.
WARM_TOKENS_PER_TURN = 64
# A session with fewer output tokens left than 1/WARM_PAYBACK of its draft's lag decodes plain to its end: a draft
# prefill token costs about a quarter of a draft step, and drafting saves a fraction of a step per token.
WARM_PAYBACK = 8
# A drafting turn in which more than 1/HELD_SHARE of the sessions drafted no full block (drafts catching up, ends of
# output) is not measured, nor is a turn that prefilled a prompt; the next turn at its load runs the same arm, at most
# MAX_CARRIED_TURNS times in a row (a trial is not lost to the prompts that keep arriving under load).
HELD_SHARE = 4
MAX_CARRIED_TURNS = 2
OVERHEAD_DECAY = 0.9  # what the measured round overhead keeps of itself at each measured turn
# While no acceptance is measured, a load explores drafting only where the cost model predicts drafting at
# EXPLORE_ALPHA (a model draft at its best: the built-in pair accepts 0.92-0.93 on the dev prompts) would gain at
# least EXPLORE_GAIN; below, the gain is within the profiles' error and the explorer's cost is sure. On a slow
# 2-core EPYC, a fresh worker's first 48-token wave at 16 and 32 streams ran 19.0 and 23.5 tok/s, its second 22.5
# and 30.1, the plain route 22.9 and 27.3 (docs/bench/explore-gate-2026-12-05).
EXPLORE_ALPHA = 0.95
EXPLORE_GAIN = 1.1


def draft_lag(session: VerifySession):
    """A local session's engine drafter (None: prompt lookup, synthetic) and the committed tokens its KV lacks."""
    drafter = engine_drafter(session.local.drafter)
    return drafter, drafter.missing(session.local.committed) if drafter is not None else 0


@dataclass
class LocalDrafting:
    """The draft this worker drafts its local sessions with, and what their block-length controllers share."""

    source: DraftSource
    speculative: SpeculativeSettings
    cost: CostModel | None = None  # this worker's verify grid and its draft's cost, not pipelined
    fallback: DraftFallback | None = None  # the draft it was given cannot run here: source is the stand-in
    draft_profile: dict = field(default_factory=dict)  # measured at start-up: draft_ms_per_token, draft_step_ms_*
    recent: RecentRounds = field(default_factory=RecentRounds)
    turns: MeasuredTurns = field(default_factory=MeasuredTurns)  # drafting or plain turns, by load
    prefill_cost: DraftPrefillCost = field(default_factory=DraftPrefillCost)  # what drafting's turns leave out
    _turn: tuple[int, str] | None = None  # this turn's load and arm, until settled
    _warm_s: float = 0.0  # this turn's catching up of lagging drafts (in prefill_cost, not in the turn's figure)
    _held: bool = False  # too few of this drafting turn's sessions drafted a full block for it to be measured
    _draft_s: float = 0.0  # this turn's drafting
    _alpha: float | None = None  # the acceptance batch_gamma read this turn (None: not measured yet)
    # by load bucket, a turn's time beyond its forward and its drafting, decayed (the cost model's round overhead;
    # it grows with the rows: building them, the round math and the commits are per session)
    overhead_ms: dict[int, float] = field(default_factory=dict)
    _carried: tuple[int, str] | None = None  # an unmeasured turn's load bucket and arm: the next turn runs it again
    _carried_turns: int = 0
    warm_tokens: int = WARM_TOKENS_PER_TURN

    @property
    def spec(self) -> str:
        return self.source.spec

    def attach(self, session: VerifySession, events: list[OutputEvent], drafting: int) -> None:
        """Give `session` its draft half, resuming after its committed output (`drafting`: local sessions)."""
        spec = session.spec
        drafter = self.source.new_drafter() if spec.route == "sd" else None
        session.local = DraftSession(spec, events, drafter=drafter, speculative=self.speculative, cost=self.cost,
                                     reply_to="", pipelined=False, recent=self.recent, draft_sessions=drafting + 1,
                                     max_plain_rounds=LOCAL_PLAIN_ROUNDS, sees_load=False)
        link_target(drafter, session.target)  # a draft that copies the target takes the target's KV

    def batch_gamma(self, load: int) -> int | None:
        """The most every local session may draft this turn, at `load` rows; 0: a plain turn. Co-located,
        drafting is not parallel to anything: any session's draft steps (and a new session's draft prefill)
        hold up every row of the step, so one session's gain may cost the batch more. Whether to draft at
        this load is measured (MeasuredTurns: this worker's drafting and plain turns at loads alike, the
        cost model's pick tried first); how long a block may be, the cost model says from the acceptance of
        recent rounds. None (each session's controller decides, exploring and falling back by its own
        acceptance) without a cost model, before the acceptance is known, and when drafting would not pay
        even for a lone stream. Before the acceptance is known, a load of more rows than one at which drafting
        would gain less than EXPLORE_GAIN even at EXPLORE_ALPHA gets a plain turn: exploring there costs every
        row the explorer's drafting and catch-up, for nothing drafting could win at that load."""
        self._turn = None
        alpha = self._alpha = self.recent.alpha()
        if self.cost is None:
            return None
        draft_cost_s = self.prefill_cost.per_output_token_s
        rows = max(1, load)
        cost = replace(self.cost, round_overhead_ms=self.overhead_ms.get(load_bucket(rows), 0.0),
                       draft_prefill_ms_per_token=1000 * draft_cost_s)
        candidates = range(max(1, self.speculative.min_draft_tokens), self.speculative.max_draft_tokens + 1)
        if alpha is None:  # nothing measured yet: explore (_explorer), unless this load has nothing to learn
            if rows > 1 and best_block_length(EXPLORE_ALPHA, cost, candidates, rows, rows)[1] < EXPLORE_GAIN:
                return 0
            return None
        if best_block_length(alpha, cost, candidates, 1, 1)[0] == 0:
            return None
        predicted = best_block_length(alpha, cost, candidates, rows, rows)[0]
        gamma = predicted or max(candidates, key=lambda g: cost.tokens_per_ms(alpha, g, rows, rows))
        carried, self._carried = self._carried, None
        if carried is not None and carried[0] == load_bucket(rows) and self._carried_turns < MAX_CARRIED_TURNS:
            arm = carried[1]  # the arm the last turn chose could not be measured: run it again
            self._carried_turns += 1
        else:
            arm = self.turns.choose(rows, DRAFT if predicted else PLAIN, draft_cost_s,
                                    explore=bool(predicted) or draft_cost_s == 0)
            self._carried_turns = 0
        self._turn = (rows, arm)
        return gamma if arm == DRAFT else 0

    def settle(self, committed: int | None, seconds: float, forward_s: float | None = None) -> None:
        """The turn is over: `committed` tokens in `seconds`, drafting included, the catching up of lagging
        drafts not (prefill_cost charges it to drafting per output token). Not measured: a turn that also
        prefilled a prompt (committed None), or a drafting turn in which more than 1/HELD_SHARE of the sessions
        drafted no full block (_classify); its arm (a trial, maybe) runs again next turn. forward_s: the step's
        forward, to measure what the turn costs beyond it and its drafting (the cost model's round overhead)."""
        if self._turn is not None:
            if committed is None or self._held:
                self._carried = (load_bucket(self._turn[0]), self._turn[1])
            else:
                self.turns.record(*self._turn, committed, max(0.0, seconds - self._warm_s))
                if forward_s is not None:
                    overhead = 1000 * max(0.0, seconds - self._warm_s - self._draft_s - forward_s)
                    bucket = load_bucket(self._turn[0])
                    last = self.overhead_ms.get(bucket)
                    self.overhead_ms[bucket] = overhead if last is None else \
                        OVERHEAD_DECAY * last + (1 - OVERHEAD_DECAY) * overhead
        self._turn, self._warm_s, self._held, self._draft_s = None, 0.0, False, 0.0

    def warm(self, sessions: Sequence[VerifySession], cap: int) -> set[int]:
        """Catch up, within this turn's budget, the drafts that lag their sessions' committed context by more
        than a block (a new session's prompt; tokens committed by plain turns); the ids of the sessions still
        lagging, which decode plain this turn rather than hold every row up for their catch-up, and of those
        too close to their end for a catch-up to pay back (they decode plain to the end). A session whose next
        block is its target-only opening is caught up after it: a catch-up before it delays its first token (a
        lone stream's TTFT was 313 ms against the plain route's 171 on a 2-core Xeon,
        docs/bench/colocated-2026-12-05)."""
        lagging, ending, before = [], set(), 0
        for session in sessions:
            if session.local.opening_next:
                continue
            drafter, missing = draft_lag(session)
            if missing > cap + 1:
                left = session.local.spec.max_new_tokens - session.local.num_output
                if left * WARM_PAYBACK < missing:  # about to end: its draft's catch-up would not pay back
                    ending.add(id(session))
                else:
                    lagging.append((session, drafter))
                    before += missing
        if not lagging:
            return ending
        started = time.perf_counter()
        by_engine: dict[int, list] = {}
        for session, drafter in lagging:
            by_engine.setdefault(id(drafter.draft_engine), []).append((drafter, session.local.committed))
        for items in by_engine.values():
            items[0][0].draft_engine.prefill_many(items, self.warm_tokens)
        seconds = time.perf_counter() - started
        self._warm_s += seconds
        still = {id(session): drafter.missing(session.local.committed) for session, drafter in lagging}
        self.prefill_cost.prefilled(before - sum(still.values()), seconds)
        return ending | {key for key, missing in still.items() if missing > cap + 1}

    def draft(self, sessions: Sequence[VerifySession], load: int | None = None) -> None:
        """Each local session without a block gets its next one, the drafting of all of them in one call (a
        model draft steps them together); the block is taken as if it had come from a draft worker. load:
        the rows the next step will hold (default: these sessions), for batch_gamma."""
        if not sessions:
            return
        rows = len(sessions) if load is None else load
        cap = self.batch_gamma(rows)
        explorer = self._explorer(sessions, rows) if cap is None else None
        if explorer is not None:  # the others decode plain this turn
            behind = self.warm([explorer], self.speculative.max_draft_tokens) | \
                {id(session) for session in sessions if session is not explorer}
        else:
            behind = self.warm(sessions, cap) if cap else set()
        # sessions whose block the end of their output cuts short draft less than the load does
        short = {id(session) for session in sessions
                 if session.local.spec.max_new_tokens - session.local.num_output <= cap + 1} if cap else set()
        for session in sessions:
            session.local.gamma_cap = 0 if id(session) in behind else cap
        calls = [(session, session.local.draft_call()) for session in sessions]
        wanted = [(session, call) for session, call in calls if call is not None]
        proposals = {}
        if wanted:
            started = time.perf_counter()
            drafted = propose_many([call for _, call in wanted])
            elapsed = time.perf_counter() - started
            self._draft_s += elapsed
            total = sum(len(proposal.token_ids) for proposal in drafted) or 1
            proposals = {id(session): (proposal, elapsed * len(proposal.token_ids) / total)
                         for (session, _), proposal in zip(wanted, drafted)}
        full = 0  # sessions that drafted a block the end of their output did not cut short
        for session in sessions:
            block = session.local.next_block(*proposals.get(id(session), (None, 0.0)))
            session.local.sent(block, b"", None)
            session.take(block)
            full += bool(block.draft_ids) and id(session) not in short
        self._classify(len(sessions), full, drafted=any(proposal.token_ids for proposal, _ in proposals.values()))

    def _explorer(self, sessions: Sequence[VerifySession], rows: int) -> VerifySession | None:
        """While no acceptance was measured yet (RecentRounds.alpha None: each session's controller explores
        drafting), with a model draft and more than one row: the one session that explores this turn, the one
        whose draft lags least (its catch-up within the turn's budget); the others decode plain. None: every
        session decides for itself (a lone stream, no cost model, prompt lookup, or the acceptance is known).
        Before, a fresh worker given 16 streams at once had every draft catch up on its whole prompt inside the
        turn's draft call, every row waiting: TTFT p99 8.1 and 7.5 s against 4.0 and 4.1 on the plain route,
        2-core EPYC; 4.7 to 6.0 s with one explorer (docs/bench/cold-start-2026-12-05)."""
        if rows <= 1 or self.cost is None or self._alpha is not None:
            return None
        candidates = [session for session in sessions if not session.local.opening_next]
        if not candidates or engine_drafter(candidates[0].local.drafter) is None:
            return None  # prompt lookup drafts at no cost and has nothing to catch up
        return min(candidates, key=lambda session: draft_lag(session)[1])

    def _classify(self, sessions: int, full: int, drafted: bool) -> None:
        """What this turn measures. A drafting turn in which no session drafted (their drafts catching up, their
        controllers falling back, their outputs about to end) is a plain turn; one in which more than
        1/HELD_SHARE of the sessions did not draft a full block says little about drafting at this load (a
        wave's last session, ending at load 1, is no lone stream) and is not measured."""
        if self._turn is None or self._turn[1] != DRAFT:
            return
        if not drafted:
            self._turn = (self._turn[0], PLAIN)
        elif (sessions - full) * HELD_SHARE > sessions:
            self._held = True

    def on_verdict(self, session: VerifySession, verdict: Verdict, drafting: int) -> None:
        """The verdict of the block the session just finished, applied to its draft half in-process."""
        session.local.on_verdict(verdict, draft_sessions=drafting)
        drafter = engine_drafter(session.local.drafter)
        if verdict.finished and drafter is not None:
            prompt = len(session.spec.prompt_ids)
            self.prefill_cost.finished(prompt - min(drafter.start, prompt), session.local.num_output)
