"""One session on the draft side, as a state machine with no I/O of its own: next block, verdict, repeat.

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
from services.models.drafters.base import DraftProposal, Drafter, block_probs, per_token_probs
from services.models.drafters.batched import DraftCall, bound_draft_context
from services.protocol import DraftBlock, OutputEvent, SessionSpec, Verdict
from services.speculative.block_length import BlockLengthController, RecentRounds, opens_plain
from services.speculative.cost_model import CostModel
from services.speculative.sampling import SamplingParams
from services.speculative.stats import SpecDecodingStats, percentile

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
    speculating: SpeculationState | None = None  # block k+1, drafted while this block is verified


class DraftSession:
    def __init__(self, spec: SessionSpec, events: list[OutputEvent], *, drafter: Drafter | None,
                 speculative: SpeculativeSettings, cost: CostModel | None, reply_to: str,
                 pipelined: bool, recent: RecentRounds | None = None, draft_sessions: int | None = None,
                 max_plain_rounds: int = MAX_PLAIN_ROUNDS, sees_load: bool = True) -> None:
        """max_plain_rounds: target-only rounds one block may ask for (fewer when a block costs no round trip:
        the controller looks at the load again after each block). sees_load False: the block-length
        controller decides as for a lone stream, by acceptance and the draft's cost alone (co-located drafting
        decides for the load itself, with gamma_cap, from turns measured at that load)."""
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
        self.recent = recent
        prior = recent.alpha() if recent is not None else None
        explore = recent.explore() if recent is not None else True
        self.controller = BlockLengthController(speculative, cost=cost, prior=prior, explore=explore)
        if recent is not None:
            # the first block meets the pool's current load, and the draft worker's (a burst of new sessions
            # shares one draft core: its batched steps can cost more than plain rounds save)
            self._observe_load(recent.rows, draft_sessions)
        self.stats = events[-1].stats.copy() if events else SpecDecodingStats()
        self.sampling = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                                       seed=spec.seed)
        self._streams: dict[int, torch.Generator] = {}  # round -> its draft stream (sampling)
        # the first block goes where the gateway found a similar request's KV (cache affinity), a resumed
        # session's to the worker that committed its last round; a worker gone by then is failed over as always
        self.sticky_worker: str | None = (events[-1].worker_id if events else spec.verify_worker) or None
        self.reply_to = reply_to
        self.pipelined = pipelined and self.drafter is not None
        # The first block: target-only while the draft prefills its KV, speculating the block after it
        # (a long prompt's draft prefill would otherwise come before the target's, on the critical path).
        self._plain_opening = self.round == 0 and opens_plain(speculative, len(spec.prompt_ids),
                                                               bool(getattr(self.drafter, "stepwise", False)))
        self._opening_block: DraftBlock | None = None  # speculated like a block accepted whole
        self.transport_ms: list[float] = []  # per round (services/link/meter.py), for the bench
        self.round_trip_ms: list[float] = []
        self.last_trip: RoundTrip | None = None  # the last verdict's, when it had one
        self.first_token_at: float | None = None
        self.timing = DraftTiming()
        self.in_flight: InFlight | None = None
        self.finish_reason: str | None = None
        # block k+1's tokens drafted while block k was verified, when the verdict confirmed them
        self._ready_ids: list[int] = []
        self._ready_probs: torch.Tensor | None = None

    # --- blocks ---------------------------------------------------------------------------------
    def _block_length(self, gamma: int | None = None, num_output: int | None = None) -> int:
        """gamma (default: the controller's) within the request's limits: a round emits up to gamma + 1
        tokens, and a degraded pool caps gamma."""
        if self.drafter is None or self._plain_opening:
            return 0
        gamma = self.controller.num_draft_tokens if gamma is None else gamma
        if self.gamma_cap is not None:
            gamma = min(gamma, self.gamma_cap)
        remaining = self.spec.max_new_tokens - (self.num_output if num_output is None else num_output)
        cap = self.spec.max_draft_tokens if self.spec.max_draft_tokens is not None else remaining
        return max(0, min(gamma, remaining - 1, cap))

    def _plain_rounds(self) -> int:
        """Target-only rounds the next block asks for (at least 1): the rest of the request on the plain
        route, else as long as the controller keeps drafting off."""
        remaining = max(1, self.spec.max_new_tokens - self.num_output)
        wanted = remaining if self.drafter is None else self.controller.num_plain_rounds
        return max(1, min(wanted, remaining, self.max_plain_rounds))

    def _make_block(self, draft_ids: list[int], probs: torch.Tensor | None, num_rounds: int = 1) -> DraftBlock:
        return DraftBlock(
            request_id=self.request_id,
            round=self.round,
            num_committed=len(self.committed),
            draft_ids=draft_ids,
            draft_probs=protocol.encode_probs(probs) if probs is not None else None,
            vocab_size=int(probs.shape[-1]) if probs is not None else 0,
            reply_to=self.reply_to,
            num_rounds=num_rounds,
        )

    def draft_call(self) -> DraftCall | None:
        """What the next block still needs drafted (the driver drafts the calls of many sessions together);
        None when the block needs no drafting (target-only, or a speculated block that is long enough)."""
        length = self._block_length()
        have = len(self._ready_ids)
        if length <= have:
            return None
        return DraftCall(self.drafter, [*self.committed, *self._ready_ids], length - have, self.sampling,
                         self._stream(self.round))

    def next_block(self, proposal: DraftProposal | None = None, draft_s: float = 0.0) -> DraftBlock:
        """The next block: the speculated tokens ready for it, topped up with `proposal` (draft_call's)."""
        self.timing.draft_s += draft_s
        length = self._block_length()
        ready_ids, ready_probs = self._ready_ids, self._ready_probs
        self._ready_ids, self._ready_probs = [], None
        if self._plain_opening:
            self._plain_opening = False
            self._opening_block = self._make_block([], None, 1)
            return self._opening_block
        if length <= 0:
            return self._make_block([], None, self._plain_rounds())
        draft_ids = ready_ids[:length]
        rows = list(ready_probs[:length]) if ready_probs is not None else [None] * len(draft_ids)
        if proposal is not None and proposal.token_ids:
            draft_ids = [*draft_ids, *proposal.token_ids]
            rows += per_token_probs(proposal)
        if not draft_ids:  # nothing to propose (no lookup match): one target-only round
            return self._make_block([], None)
        return self._make_block(draft_ids, block_probs(rows, draft_ids))

    def _stream(self, round_index: int) -> torch.Generator:
        """Round r's draft randomness: its own seeded stream, so the draft of a round is the same
        whether it was speculated during round r-1 or drafted after it."""
        if round_index not in self._streams:
            self._streams = {r: g for r, g in self._streams.items() if r >= round_index - 1}
            self._streams[round_index] = self.sampling.make_stream("draft", round_index)
        return self._streams[round_index]

    def sent(self, block: DraftBlock, payload: bytes, worker: str | None, sent_at: float | None = None,
             sent_wall: float | None = None) -> None:
        """sent_at (perf_counter) and sent_wall (time.time): when the push began (default: now)."""
        self.in_flight = InFlight(block, payload, worker, time.perf_counter() if sent_at is None else sent_at,
                                  time.time() if sent_wall is None else sent_wall)

    # --- pipelining -----------------------------------------------------------------------------
    def speculation(self) -> SpeculationState | None:
        """The speculation of block k+1 while block k is out (assuming k is accepted whole): started on the
        first call, then the same state, which the driver steps together with other sessions'."""
        flight = self.in_flight
        if not self.pipelined or flight is None:
            return None
        if not flight.block.draft_ids and flight.block is not self._opening_block:
            return None  # target-only rounds: the next block is drafted from their verdict
        if flight.speculating is None:
            num_sent = len(flight.block.draft_ids)
            next_length = self._block_length(self.controller.after(num_sent, num_sent),
                                             self.num_output + num_sent + 1)
            if next_length <= 0:
                return None
            flight.speculating = SpeculationState(self.drafter, [*self.committed, *flight.block.draft_ids],
                                                  next_length, self.sampling, self._stream(self.round + 1),
                                                  self.sampling.make_stream("guess", self.round))
            self.timing.speculations += 1
        return flight.speculating

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
        if verdict.worker_id and verdict.verify_started_at:  # resyncs and failures report no verify time
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
        self._observe_load(verdict.batch_rows, draft_sessions)
        if self.recent is not None:
            self.recent.observe(verdict.num_draft_tokens, verdict.num_accepted, verdict.batch_rows)
        if verdict.num_draft_tokens or flight.block.draft_ids:
            self.controller.update(verdict.num_draft_tokens, verdict.num_accepted)

        for _ in range(verdict.num_rounds - (1 if flight.block.draft_ids else 0)):
            self.controller.update(0, 0)
        self.sticky_worker = verdict.worker_id or self.sticky_worker
        self.round += verdict.num_rounds
        if verdict.finished:
            self.finish_reason = verdict.finish_reason or "stop"
            return True
        if speculation is not None and verdict.num_rounds == 1 and \
                speculation_holds(speculation, len(flight.block.draft_ids), verdict):
            if self._block_length() > 0 and speculation.draft_ids:
                # the speculated block is this round's; a short one is topped up from the same stream
                self._ready_ids, self._ready_probs = speculation.draft_ids, speculation.draft_probs
                self.timing.speculation_hits += 1
                self.timing.hidden_s += hidden_seconds(speculation, flight.sent_wall, verdict.verify_finished_at)
        if not self._ready_ids:
            self._streams.pop(self.round, None)  # a dropped speculation used this round's stream: start it over
        return False

    def _observe_load(self, rows: float, draft_sessions: int | None) -> None:
        if self.sees_load:
            self.controller.observe_load(rows, draft_sessions)
        else:
            self.controller.observe_load(1.0, 1)

    # --- the end --------------------------------------------------------------------------------
    def summary(self) -> SessionSummary:
        return SessionSummary(self.request_id, self.finish_reason or "length", self.num_output, self.round,
                              self.stats, self.transport_ms, self.first_token_at, self.resumed_from_round,
                              self.timing, self.round_trip_ms)

    def release_block(self) -> DraftBlock:
        """Tells the verify side to free the session's KV cache (cancellation, failure)."""
        return DraftBlock(request_id=self.request_id, round=self.round, num_committed=len(self.committed),
                          draft_ids=[], release=True)

    def release(self) -> None:
        if self.drafter is not None:
            self.drafter.release()

    def progress(self) -> dict:
        return {
            "request_id": self.request_id,
            "tokens": self.num_output,
            "rounds": self.round,
            "acceptance_rate": self.stats.acceptance_rate,
            "mean_acceptance_length": self.stats.mean_acceptance_length,
            "num_draft_tokens": self.controller.num_draft_tokens,
        }
