"""One session on the draft side, as a state machine with no I/O of its own: next block, verdict, repeat.
(Over 300 lines: one state machine, whose transitions, chains included, read best side by side.)

The driver (draft_worker/driver.py) owns the Redis traffic of every session
of the process and calls in here: `on_verdict()` per verdict, `draft_call()`
and `next_block()` for each block (the driver drafts many sessions' calls
together), and `speculation()` while a block is out, whose state the driver
steps with other sessions' to draft block k+1 on the assumption that block k
is accepted whole (services/engine/draft_pipeline.py).

Block length: the controller (services/speculative/block_length.py) reads
acceptance from the verdicts and, under the cost policy, the load: each
verdict says how many rows shared the step, and the step-cost grid of the
pool says what a longer block adds there. When drafting does not pay, the
block carries target-only rounds that the verify worker runs on its own.
Round r's randomness is the stream ("draft", r), wherever it is drafted.

Blocks ahead: a speculated block may go out before the verdict it assumes
(`chained_block()`, up to `blocks_ahead` out), chained to the block before
it; a verdict then either promotes the next block out to the one in flight
or drops them all (services/speculative/chaining.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from services.engine.draft_pipeline import DraftTiming, SpeculationState, hidden_seconds, speculation_holds
from services import protocol
from services.config import SpeculativeSettings
from services.link.meter import RoundTrip, transport_ms
from services.models.drafters.base import DraftProposal, Drafter, block_probs, per_token_probs, reads_prompt
from services.models.drafters.batched import DraftCall, bound_draft_context
from services.models.drafters.suffix import bind_prices, bind_tenant
from services.protocol import DraftBlock, OutputEvent, SessionSpec, Verdict
from services.speculative.block_length import BlockLengthController, RecentRounds, opens_plain, within_limits
from services.speculative.bridging import bridge_lead
from services.speculative.chaining import chain_holds, followed
from services.speculative.cost_model import CostModel
from services.speculative.stats import SUFFIX_DRAFTERS, SpecDecodingStats, model_round, percentile

logger = logging.getLogger(__name__)

MAX_PLAIN_ROUNDS = 64  # target-only rounds per block: a verdict (and a chance to draft again) at least this often


@dataclass
class SessionSummary:
    request_id: str
    finish_reason: str
    num_output_tokens: int
    rounds: int
    stats: SpecDecodingStats
    transport_ms: list[float]
    first_token_at: float | None
    resumed_from_round: int
    timing: DraftTiming = field(default_factory=DraftTiming)
    round_trip_ms: list[float] = field(default_factory=list)  # block sent -> verdict seen, per drafted round
    plain_reason: str | None = None  # why it went target-only for a while (DraftSession.plain_reason)

    def to_dict(self) -> dict:
        return {
            "request_id": self.request_id,
            "finish_reason": self.finish_reason,
            "num_output_tokens": self.num_output_tokens,
            "rounds": self.rounds,
            "resumed_from_round": self.resumed_from_round,
            "transport_ms_p50": percentile(self.transport_ms, 0.5),
            "transport_ms_p99": percentile(self.transport_ms, 0.99),
            "round_trip_ms_p50": percentile(self.round_trip_ms, 0.5),
            "first_token_at": self.first_token_at,
            "plain_reason": self.plain_reason,
            **self.timing.as_fields(),
            **{k: v for k, v in self.stats.to_dict().items() if not k.endswith("_per_pos")},
        }


@dataclass
class InFlight:
    block: DraftBlock
    payload: bytes
    worker: str | None  # the sticky worker it went to; None = the pool
    sent_at: float  # perf_counter, taken before the push: the round trip starts there
    sent_wall: float  # time.time, the same moment
    context: list[int] = field(default_factory=list)  # the context the block assumes, its draft tokens included
    speculating: SpeculationState | None = None  # block k+1, drafted while this block is verified
    chained: bool = False  # block k+1 went out from that speculation, ahead of this block's verdict
    measured: bool = True  # its round trip is this side's (False: the gateway sent it, SessionSpec.opened)
    unanswered_periods: int = 0  # RESEND_AFTER_S periods its live worker let pass (draft_worker/driver.py)

    @property
    def ahead_of_verdict(self) -> bool:
        """Sent chained to the block before it (services/speculative/chaining.py)."""
        return self.block.parent_id != 0


class DraftSession:
    def __init__(self, spec: SessionSpec, events: list[OutputEvent], *, drafter: Drafter | None,
                 speculative: SpeculativeSettings, cost: CostModel | None, reply_to: str,
                 pipelined: bool, recent: RecentRounds | None = None, draft_sessions: int | None = None,
                 max_plain_rounds: int = MAX_PLAIN_ROUNDS, sees_load: bool = True,
                 told: Verdict | None = None) -> None:
        """max_plain_rounds: target-only rounds one block may ask for (fewer when a block costs no round trip:
        the controller looks at the load again after each block). sees_load False: the block-length
        controller decides as for a lone stream, by acceptance and the draft's cost alone (co-located drafting
        decides for the load itself, with gamma_cap, from turns measured at that load). told: its opening's
        verdict, answered before the session started: the load its verify worker told then, instead of the last
        any session of this draft worker heard; taken only while it answers the last round in `events` (a session
        resumed later, after a failover, starts from what this draft worker heard last)."""
        self.spec = spec
        self.request_id = spec.request_id
        self.max_plain_rounds = max_plain_rounds
        self.sees_load = sees_load
        # set by a driver that decides block lengths for all its sessions at once (co-located drafting: the
        # whole batch waits for any session's drafting); None: this session's controller alone decides
        self.gamma_cap: int | None = None
        self.committed: list[int] = [*spec.prompt_ids, *(t for e in events for t in e.token_ids)]
        self.num_output = sum(len(e.token_ids) for e in events)
        self.round = len(events)
        self.resumed_from_round = self.round
        self.drafter = drafter if spec.route == "sd" else None
        bound_draft_context(self.drafter, len(spec.prompt_ids), speculative.draft_context_tokens)
        bind_tenant(self.drafter, spec.tenant)
        self.recent = recent
        prior = recent.alpha() if recent is not None else None
        # only a session that may draft takes a turn at exploring (a plain-route session would use up the turn)
        explore = recent.explore() if recent is not None and self.drafter is not None else True
        self.controller = BlockLengthController(speculative, cost=cost, prior=prior, explore=explore)
        bind_prices(self.drafter, cost, self.controller.prior)
        self.sampling = spec.sampling
        if told is not None and told.round + max(1, told.num_rounds) == len(events):
            # its last round's verdict: its own verify worker's word, newer than what other sessions heard before
            self._observe_load(told.batch_rows, draft_sessions, told.load_arm)
        elif recent is not None:
            # the first block meets the pool's current load, and the draft worker's (a burst of new sessions
            # shares one draft core: its batched steps can cost more than plain rounds save), and its last word
            self._observe_load(recent.rows, draft_sessions, recent.word)
        self.stats = events[-1].stats.copy() if events else SpecDecodingStats()
        self._streams: dict[int, torch.Generator] = {}  # round -> its draft stream (sampling)
        # the first block goes where the gateway found a similar request's KV (cache affinity), a resumed
        # session's to the worker that committed its last round; a worker gone by then is failed over as always
        self.sticky_worker: str | None = (events[-1].worker_id if events else spec.verify_worker) or None
        self.reply_to = reply_to
        self.pipelined = pipelined and self.drafter is not None
        # The first block: target-only while the draft prefills its KV, speculating the block after it
        # (a long prompt's draft prefill would otherwise come before the target's, on the critical path).
        self._plain_opening = self.round == 0 and opens_plain(speculative, len(spec.prompt_ids),
                                                               reads_prompt(self.drafter))
        self._opening_block: DraftBlock | None = None  # speculated like a block accepted whole
        self.transport_ms: list[float] = []  # per round (services/link/meter.py), for the bench
        self.round_trip_ms: list[float] = []
        self.last_trip: RoundTrip | None = None  # the last verdict's, when it had one
        self.first_token_at: float | None = None
        self.timing = DraftTiming()
        self.in_flight: InFlight | None = None  # the block whose verdict comes next
        # blocks sent after it, each chained to the one before (services/speculative/chaining.py); the driver
        # sets how many may be out (blocks_ahead, counting in_flight), 1 = none ahead
        self.ahead: list[InFlight] = []
        self.blocks_ahead = 1
        self.last_chained = False  # the last verdict answered a block sent ahead of its parent's verdict
        self._block_serial = 0
        self._said_plain = False
        self.finish_reason: str | None = None
        # block k+1's tokens drafted while block k was verified, when the verdict confirmed them
        self._ready_ids: list[int] = []
        self._ready_probs: torch.Tensor | None = None
        self._ready_drafter = ""
        self._bridged_hint = 0  # rounds the verify worker bridged before the last block drafted from a verdict
        self._lead = 0  # rounds the next block also drafts for its bridge to have run (after a catch-up read)
        self._plain_for_load = False  # it sent target-only rounds for the load (the verify worker's word, its grid)
        # its opening's verdict came with no block ready: its verify worker may decode it on its own until the next
        # block comes (draft_prefill "after_opening"), and catch_up() can take those rounds before drafting it
        self.catching_up = False
        # SessionSpec.opened: the gateway sent round 0 itself; its verdict comes on the request's own verdict list
        # (the draft worker moves it into its inbox: draft_worker/opening.py)
        self.awaits_opening = spec.opened and self.round == 0
        if self.awaits_opening:
            self._plain_opening = False
            opening = protocol.opening_block(spec)
            self._block_serial = opening.block_id
            self._opening_block = opening  # speculated after like a block accepted whole
            self.sent(opening, opening.encode(), spec.verify_worker or None)
            self.in_flight.measured = False

    # --- blocks ---------------------------------------------------------------------------------
    def _block_length(self, gamma: int | None = None, num_output: int | None = None) -> int:
        """gamma (default: the controller's) within the request's limits: a round emits up to gamma + 1
        tokens, and a degraded pool caps gamma. A block drafted from a verdict (no speculation ready) also
        covers the rounds its verify worker bridged last time (services/speculative/bridging.py): they are
        checked there, not verified, so gamma tokens are left to verify after them."""
        if self.drafter is None or self._plain_opening:
            return 0
        if gamma is None:
            gamma = self.controller.num_draft_tokens
            if gamma > 0 and not self._ready_ids:
                gamma += max(min(self._bridged_hint, gamma), self._lead)
        remaining = self.spec.max_new_tokens - (self.num_output if num_output is None else num_output)
        return within_limits(gamma, remaining, self.gamma_cap, self.spec.max_draft_tokens)

    def _plain_rounds(self) -> int:
        """Target-only rounds the next block asks for (at least 1): the rest of the request on the plain
        route, else as long as the controller keeps drafting off."""
        remaining = max(1, self.spec.max_new_tokens - self.num_output)
        wanted = remaining if self.drafter is None else self.controller.num_plain_rounds
        return max(1, min(wanted, remaining, self.max_plain_rounds))

    def _make_block(self, draft_ids: list[int], probs: torch.Tensor | None, num_rounds: int = 1, *,
                    round_index: int | None = None, num_committed: int | None = None,
                    parent: DraftBlock | None = None, assumed_bonus: int = -1, drafter: str = "") -> DraftBlock:
        self._block_serial += 1
        return DraftBlock(
            request_id=self.request_id,
            round=self.round if round_index is None else round_index,
            num_committed=len(self.committed) if num_committed is None else num_committed,
            draft_ids=draft_ids,
            draft_probs=protocol.encode_probs(probs) if probs is not None else None,
            vocab_size=int(probs.shape[-1]) if probs is not None else 0,
            reply_to=self.reply_to,
            num_rounds=num_rounds,
            block_id=self._block_serial,
            parent_id=parent.block_id if parent is not None else 0,
            assumed_bonus=assumed_bonus,
            drafter=drafter if draft_ids else "",
        )

    def draft_call(self) -> DraftCall | None:
        """What the next block still needs drafted (the driver drafts the calls of many sessions together);
        None when the block needs no drafting (target-only, or a speculated block that is long enough)."""
        length = self._block_length()
        have = len(self._ready_ids)
        if length <= have:
            return None
        remaining = self.spec.max_new_tokens - self.num_output
        longest = within_limits(remaining, remaining, self.spec.max_draft_tokens) - have  # a suffix draft's
        return DraftCall(self.drafter, [*self.committed, *self._ready_ids], length - have, self.sampling,
                         self._stream(self.round), max_draft_tokens=max(longest, length - have))

    def next_block(self, proposal: DraftProposal | None = None, draft_s: float = 0.0) -> DraftBlock:
        """The next block: the speculated tokens ready for it, topped up with `proposal` (draft_call's)."""
        self.timing.draft_s += draft_s
        self.catching_up = False
        length = self._block_length()
        self._lead = 0
        ready_ids, ready_probs, ready_drafter = self._ready_ids, self._ready_probs, self._ready_drafter
        self._ready_ids, self._ready_probs, self._ready_drafter = [], None, ""
        if self._plain_opening:
            self._plain_opening = False
            self._opening_block = self._make_block([], None, 1)
            return self._opening_block
        if length <= 0:
            if self.drafter is not None and not self.controller.fallen_back and self.controller.num_draft_tokens == 0:
                self._plain_for_load = True
            if self.controller.fallen_back and self.controller.fallback_reason == "link" and not self._said_plain:
                self._said_plain = True
                logger.info("request %s: its draft link makes drafting lose (%.0f ms a round not verified "
                            "ahead): target-only rounds on the verify worker", self.request_id,
                            self.controller.cost.link_ms, extra={"request_id": self.request_id})
            return self._make_block([], None, self._plain_rounds())
        draft_ids = ready_ids[:length]
        rows = list(ready_probs[:length]) if ready_probs is not None else [None] * len(draft_ids)
        drafter = ready_drafter if draft_ids else ""
        if proposal is not None and proposal.token_ids:
            drafter = drafter if draft_ids else proposal.drafter  # the block's first token's drafter
            draft_ids = [*draft_ids, *proposal.token_ids]
            rows += per_token_probs(proposal)
        if not draft_ids:  # nothing to propose (no lookup match): one target-only round
            return self._make_block([], None)
        return self._make_block(draft_ids, block_probs(rows, draft_ids), drafter=drafter)

    def _stream(self, round_index: int) -> torch.Generator:
        """Round r's draft randomness: its own seeded stream, so the draft of a round is the same
        whether it was speculated during round r-1 or drafted after it."""
        if round_index not in self._streams:
            self._streams = {r: g for r, g in self._streams.items() if r >= self.round - 1}
            self._streams[round_index] = self.sampling.make_stream("draft", round_index)
        return self._streams[round_index]

    def sent(self, block: DraftBlock, payload: bytes, worker: str | None, sent_at: float | None = None,
             sent_wall: float | None = None) -> None:
        """sent_at (perf_counter) and sent_wall (time.time): when the push began (default: now). A chained
        block (chained_block()'s) goes behind the blocks out, the others are the block in flight."""
        flight = InFlight(block, payload, worker, time.perf_counter() if sent_at is None else sent_at,
                          time.time() if sent_wall is None else sent_wall)
        if block.parent_id:
            tail = self._tail()
            assert tail is not None and tail.block.block_id == block.parent_id, "a chained block without its parent"
            flight.context = [*tail.context, block.assumed_bonus, *block.draft_ids]
            tail.chained = True
            self.ahead.append(flight)
        else:
            flight.context = [*self.committed, *block.draft_ids]
            self.in_flight = flight

    def drop_ahead(self) -> None:
        """Forget the blocks sent ahead (a failover or a resend: the block in flight goes again alone, and
        the chain starts over from its verdict)."""
        self.ahead = []
        if self.in_flight is not None:
            self.in_flight.chained = False
            self.in_flight.speculating = None
        self._restart_streams(self.round + 1)

    def _tail(self) -> InFlight | None:
        return self.ahead[-1] if self.ahead else self.in_flight

    @property
    def in_opening(self) -> bool:
        """Its opening round (target-only, while the draft may prefill) is out."""
        return self.in_flight is not None and self.in_flight.block is self._opening_block

    @property
    def opening_next(self) -> bool:
        """Its next block is the target-only opening: the first token waits for the target's prefill alone,
        and the draft's prefill can come after it."""
        return self._plain_opening

    @property
    def will_draft(self) -> bool:
        """Its next block, drafted now, would carry draft tokens (not target-only rounds)."""
        return self._block_length() > 0

    def observe_draft_sessions(self, draft_sessions: int) -> None:
        """The sessions its draft worker drives now: a burst that came after this session was created makes its
        opening's speculation (and that prompt's draft prefill) cost what that load says, or not start."""
        if self.sees_load:
            self.controller.observe_load(self.controller.rows, draft_sessions, self.controller.load_word)

    @property
    def keeps_the_draft_busy(self) -> bool:
        """The draft drafts for it now or at its next verdict (the draft-side twin of the verify worker's
        VerifySession.keeps_a_draft_busy): a block with draft tokens out, one to draft, or the opening; not
        target-only rounds after it, nor the plain route."""
        if self.drafter is None:
            return False
        flight = self.in_flight
        return flight is None or bool(flight.block.draft_ids) or flight.block is self._opening_block

    # --- pipelining -----------------------------------------------------------------------------
    def speculation(self) -> SpeculationState | None:
        """The speculation of the block after the last one out (assuming that one is accepted whole): started
        on the first call, then the same state, which the driver steps together with other sessions'."""
        tail = self._tail()
        if not self.pipelined or tail is None or tail.chained:
            return None
        if not tail.block.draft_ids and tail.block is not self._opening_block:
            return None  # target-only rounds: the next block is drafted from their verdict
        if tail.speculating is None:
            num_sent = len(tail.block.draft_ids)
            assumed_output = len(tail.context) + 1 - len(self.spec.prompt_ids)
            next_length = self._block_length(self.controller.after(num_sent, num_sent), assumed_output)
            if next_length <= 0:
                return None
            tail.speculating = SpeculationState(self.drafter, tail.context, next_length, self.sampling,
                                                self._stream(tail.block.round + 1),
                                                self.sampling.make_stream("guess", tail.block.round))
            self.timing.speculations += 1
        return tail.speculating

    def chained_block(self) -> DraftBlock | None:
        """The next block to send ahead of the verdicts, when blocks_ahead allows one more and the speculation
        after the last block out is complete: chained to that block, assuming it accepted whole with the
        speculation's guess as bonus. Only to a known verify worker (the one holding the chain's parent)."""
        if not self.ahead_ready(self.blocks_ahead):
            return None
        tail = self._tail()
        speculation = tail.speculating.result()
        return self._make_block(speculation.draft_ids, speculation.draft_probs, 1, round_index=tail.block.round + 1,
                                num_committed=len(tail.context) + 1, parent=tail.block,
                                assumed_bonus=speculation.bonus_guess, drafter=speculation.drafter)

    def ahead_ready(self, depth: int) -> bool:
        """A block could go ahead now, with `depth` blocks allowed out."""
        tail = self._tail()
        if tail is None or tail.chained or 1 + len(self.ahead) >= depth or self.in_flight.worker is None:
            return False
        state = tail.speculating
        if tail.block.num_rounds != 1 or state is None or not state.done:
            return False
        return len(state.tokens) > 1  # the guess and at least one draft token

    # --- verdicts -------------------------------------------------------------------------------
    def on_verdict(self, verdict: Verdict, draft_sessions: int | None = None, seen_at: float | None = None,
                   held_s: float = 0.0) -> bool:
        """Apply the verdict of the block in flight; True when the request ended. The next block then comes
        from draft_call() and next_block(). draft_sessions: how many sessions this draft worker drives (its
        batched draft steps serve them all). seen_at (perf_counter, default now): when the pop that returned
        the verdict returned; held_s: how long it waited on the driver's other work (services/link/meter.py)."""
        flight = self.in_flight
        assert flight is not None and verdict.round == self.round, "a verdict for another round"
        self.in_flight = None
        speculation = flight.speculating.result() if flight.speculating is not None else None
        if speculation is not None:
            self.timing.speculation_s += speculation.elapsed_s
        self.last_trip = None
        self.last_chained = flight.ahead_of_verdict and bool(verdict.worker_id)
        if verdict.worker_id and verdict.verify_started_at and not flight.ahead_of_verdict and flight.measured:
            # a block's trip over the link; one sent ahead of its parent's verdict made none of its own
            round_trip_s = (time.perf_counter() if seen_at is None else seen_at) - flight.sent_at
            verify_s = verdict.verify_finished_at - verdict.verify_started_at  # both on the verify worker's clock
            self.last_trip = RoundTrip(1000 * round_trip_s, transport_ms(round_trip_s, verify_s, held_s),
                                       1000 * verify_s)
            self.round_trip_ms.append(self.last_trip.round_trip_ms)
            self.transport_ms.append(self.last_trip.transport_ms)
        self.committed.extend(verdict.committed_ids)
        self.num_output = verdict.num_committed - len(self.spec.prompt_ids)
        if verdict.committed_ids and self.first_token_at is None:
            self.first_token_at = time.time()
        self.stats = verdict.stats
        self._observe_load(verdict.batch_rows, draft_sessions, verdict.load_arm)
        # the block length and the fallback are the model draft's: a suffix draft's round is free, and its own
        # acceptance goes to the per-round choice (drafters/suffix.py), not to the controller
        drafted, accepted = model_round(flight.block.drafter, verdict.num_draft_tokens, verdict.num_accepted)
        if self.recent is not None:
            self.recent.observe(drafted, accepted, verdict.batch_rows, verdict.load_arm)
        if drafted or (flight.block.draft_ids and flight.block.drafter not in SUFFIX_DRAFTERS):
            self.controller.update(drafted, accepted)
        elif flight.block.draft_ids:
            self.controller.update(0, 0)

        # target-only rounds the block asked for (those the verify worker bridged before it came are not)
        for _ in range(verdict.num_rounds - verdict.num_bridged - (1 if flight.block.draft_ids else 0)):
            self.controller.update(0, 0)
        self.sticky_worker = verdict.worker_id or self.sticky_worker
        if verdict.worker_id and not flight.ahead_of_verdict and flight.block.draft_ids:
            self._bridged_hint = verdict.num_bridged
        self.round += verdict.num_rounds
        if verdict.finished:
            self.finish_reason = verdict.finish_reason or "stop"
            self.ahead = []
            return True
        if self.ahead:
            return self._follow_chain(flight, verdict, speculation)
        if speculation is not None and not flight.chained and \
                speculation_holds(speculation, len(flight.block.draft_ids), verdict):
            if self._block_length() > 0 and speculation.draft_ids:
                # the speculated block is this round's; a short one is topped up from the same stream
                self._ready_ids, self._ready_probs = speculation.draft_ids, speculation.draft_probs
                self._ready_drafter = speculation.drafter
                self.timing.speculation_hits += 1
                self.timing.hidden_s += hidden_seconds(speculation, flight.sent_wall, verdict.verify_finished_at)
        if not self._ready_ids:
            self._streams.pop(self.round, None)  # a dropped speculation used this round's stream: start it over
        self.catching_up = flight.block is self._opening_block and not self._ready_ids
        return False

    def catch_up(self, events: list[OutputEvent]) -> int:
        """Take the rounds its verify worker committed on its own since the last verdict (bridging while this
        draft prefilled), read from the request's stream, as committed: the next block is then drafted from
        where the target is now instead of from a point the bridge has left behind. Only one-token rounds, in
        order from this round on, none that finished (that verdict comes as usual). Returns the rounds taken."""
        self.catching_up = False
        if self.in_flight is not None or self.ahead or self._ready_ids:
            return 0
        taken = 0
        for event in sorted(events, key=lambda event: event.seq):
            if event.seq < self.round:
                continue
            if event.seq != self.round or event.finished or len(event.token_ids) != 1:
                break
            self.committed.extend(event.token_ids)
            self.round += 1
            self.num_output = event.num_output_tokens
            self.stats = event.stats
            taken += 1
        self.timing.caught_up_rounds += taken
        cost, controller = self.controller.cost, self.controller
        if cost is not None and self.drafter is not None:  # the bridge goes on while this block is on its way
            # at the load it meets: its draft worker's batched step of all its sessions, a bridged round a row of
            # the step of that many rows (a draft step dearer than a bridged one: no lead)
            draft_ms = cost.draft_cost(controller.draft_sessions or 1)
            lead = bridge_lead(cost.link_ms, controller.num_draft_tokens, draft_ms,
                               cost.step_cost(controller.load, 1) + cost.round_overhead_ms)
            self._lead = min(lead, controller.config.max_draft_tokens)
        return taken

    def _follow_chain(self, flight: InFlight, verdict: Verdict, speculation) -> bool:
        """The verdict of a block with blocks sent after it: when the next one's assumption held, the verify
        worker is on it already and it is the block in flight now; else the chain is dropped here as there,
        and the next block is drafted from the verdict."""
        child = self.ahead[0]
        if chain_holds(verdict, flight.block, child.block):
            self.ahead.pop(0)
            renumbered = followed(child.block, verdict)  # rounds bridged before its parent moved it
            if renumbered is not child.block:
                child.block, child.payload = renumbered, renumbered.encode()
            child.sent_at, child.sent_wall = time.perf_counter(), time.time()  # its wait for a verdict starts now
            self.in_flight = child
            self.timing.speculation_hits += 1
            self.timing.chained_rounds += 1
            if speculation is not None:
                self.timing.hidden_s += speculation.elapsed_s  # drafted and sent before the verdict existed
            return False
        self.ahead = []
        self.timing.chains_broken += 1
        self._restart_streams(self.round)
        return False

    def _restart_streams(self, first_round: int) -> None:
        """Dropped blocks (and the speculation after them) drew from the streams of their rounds: those rounds
        start their streams over, so each draws what it would have drawn had nothing been sent ahead."""
        self._streams = {r: g for r, g in self._streams.items() if r < first_round}

    def _observe_load(self, rows: float, draft_sessions: int | None, word: str = "") -> None:
        if self.sees_load:
            # a seeded request's drafted rounds must not hang on timing: it drafts as its controller says
            self.controller.observe_load(rows, draft_sessions, word if self.sampling.layout_free else "")
        else:
            self.controller.observe_load(1.0, 1)

    # --- the end --------------------------------------------------------------------------------
    def summary(self) -> SessionSummary:
        return SessionSummary(self.request_id, self.finish_reason or "length", self.num_output, self.round,
                              self.stats, self.transport_ms, self.first_token_at, self.resumed_from_round,
                              self.timing, self.round_trip_ms, self.plain_reason)

    @property
    def plain_reason(self) -> str | None:
        """Why it went target-only for a while: its controller's fallback ("acceptance", "cost", "link"), else
        "load" when it sent target-only rounds for the load (the verify worker's word "plain", or its step grid
        at that load), else None."""
        return self.controller.fallback_reason or ("load" if self._plain_for_load else None)

    def release_block(self) -> DraftBlock:
        """Tells the verify side to free the session's KV cache (cancellation, failure)."""
        return DraftBlock(request_id=self.request_id, round=self.round, num_committed=len(self.committed),
                          draft_ids=[], release=True)

    def release(self) -> None:
        if self.drafter is not None:
            self.drafter.release()

