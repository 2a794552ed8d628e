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
from dataclasses import dataclass, field

from services.config import SpeculativeSettings
from services.engine.draft_session import DraftSession
from services.models.drafters.batched import propose_many
from services.models.drafters.factory import DraftSource
from services.protocol import DraftFallback, OutputEvent, Verdict
from services.speculative.block_length import RecentRounds
from services.speculative.cost_model import CostModel, best_block_length
from services.speculative.measured_turns import DRAFT, PLAIN, MeasuredTurns
from verify_worker.sessions import VerifySession

logger = logging.getLogger(__name__)

# Target-only rounds per block of a local session: a block costs no round trip here, so every turn decides
# again, at its load, whether to draft (a remote block asks for up to 64, to spare the Redis round trips).
LOCAL_PLAIN_ROUNDS = 1


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
    _turn: tuple[int, str] | None = None  # this turn's load and arm, until settled

    @property
    def spec(self) -> str:
        return self.source.spec

    def attach(self, session: VerifySession, events: list[OutputEvent], drafting: int) -> None:
        """Give `session` its draft half, resuming after its committed output (`drafting`: local sessions)."""
        spec = session.spec
        drafter = self.source.new_drafter() if spec.route == "sd" else None
        session.local = DraftSession(spec, events, drafter=drafter, speculative=self.speculative, cost=self.cost,
                                     reply_to="", pipelined=False, recent=self.recent, draft_sessions=drafting + 1,
                                     max_plain_rounds=LOCAL_PLAIN_ROUNDS)

    def batch_gamma(self, load: int) -> int | None:
        """The most every local session may draft this turn, at `load` rows; 0: a plain turn. Co-located,
        drafting is not parallel to anything: any session's draft steps (and a new session's draft prefill)
        hold up every row of the step, so one session's gain may cost the batch more. Whether to draft at
        this load is measured (MeasuredTurns: this worker's drafting and plain turns at loads alike, the
        cost model's pick tried first); how long a block may be, the cost model says from the acceptance of
        recent rounds. None (each session's controller decides, exploring and falling back by its own
        acceptance) without a cost model, before the acceptance is known, and when drafting would not pay
        even for a lone stream."""
        self._turn = None
        alpha = self.recent.alpha()
        if self.cost is None or alpha is None:
            return None
        candidates = range(max(1, self.speculative.min_draft_tokens), self.speculative.max_draft_tokens + 1)
        if best_block_length(alpha, self.cost, candidates, 1, 1)[0] == 0:
            return None
        rows = max(1, load)
        predicted = best_block_length(alpha, self.cost, candidates, rows, rows)[0]
        gamma = predicted or max(candidates, key=lambda g: self.cost.tokens_per_ms(alpha, g, rows, rows))
        arm = self.turns.choose(rows, DRAFT if predicted else PLAIN)
        self._turn = (rows, arm)
        return gamma if arm == DRAFT else 0

    def settle(self, committed: int | None, seconds: float) -> None:
        """The turn is over: `committed` tokens in `seconds`, drafting included (None: a turn that also
        prefilled a prompt, not measured)."""
        if self._turn is not None and committed is not None:
            self.turns.record(*self._turn, committed, seconds)
            self._turn = None

    def draft(self, sessions: Sequence[VerifySession], load: int | None = None) -> None:
        """Each local session without a block gets its next one, the drafting of all of them in one call (a
        model draft steps them together); the block is taken as if it had come from a draft worker. load:
        the rows the next step will hold (default: these sessions), for batch_gamma."""
        if not sessions:
            return
        cap = self.batch_gamma(len(sessions) if load is None else load)
        for session in sessions:
            session.local.gamma_cap = cap
        calls = [(session, session.local.draft_call()) for session in sessions]
        wanted = [(session, call) for session, call in calls if call is not None]
        proposals = {}
        if wanted:
            started = time.perf_counter()
            drafted = propose_many([call for _, call in wanted])
            elapsed = time.perf_counter() - started
            total = sum(len(proposal.token_ids) for proposal in drafted) or 1
            proposals = {id(session): (proposal, elapsed * len(proposal.token_ids) / total)
                         for (session, _), proposal in zip(wanted, drafted)}
        for session in sessions:
            block = session.local.next_block(*proposals.get(id(session), (None, 0.0)))
            session.local.sent(block, b"", None)
            session.take(block)

    def on_verdict(self, session: VerifySession, verdict: Verdict, drafting: int) -> None:
        """The verdict of the block the session just finished, applied to its draft half in-process."""
        session.local.on_verdict(verdict, draft_sessions=drafting)
