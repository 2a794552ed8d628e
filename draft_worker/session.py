"""One session on the draft side, as a state machine with no I/O of its own: next block, verdict, repeat.

The driver (draft_worker/driver.py) owns the Redis traffic of every session
of the process and calls in here: `first_block()` once, `on_verdict()` per
verdict (which returns the next block, or None when the request ended), and
`speculate()` while a block is out, to draft block k+1 on the assumption
that block k is accepted whole (draft_worker/pipeline.py).

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

from draft_worker.pipeline import DraftTiming, Speculation, hidden_seconds, speculate, speculation_holds
from services import protocol
from services.config import SpeculativeSettings
from services.models.drafters.base import Drafter
from services.protocol import DraftBlock, OutputEvent, SessionSpec, Verdict
from services.speculative.block_length import BlockLengthController
from services.speculative.cost_model import CostModel
from services.speculative.sampling import SamplingParams
from services.speculative.stats import SpecDecodingStats

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

    def to_dict(self) -> dict:
        ordered = sorted(self.transport_ms)

        def pct(q: float) -> float | None:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None

        return {
            "request_id": self.request_id,
            "finish_reason": self.finish_reason,
            "num_output_tokens": self.num_output_tokens,
            "rounds": self.rounds,
            "resumed_from_round": self.resumed_from_round,
            "transport_ms_p50": pct(0.5),
            "transport_ms_p99": pct(0.99),
            "first_token_at": self.first_token_at,
            **self.timing.as_fields(),
            **{k: v for k, v in self.stats.to_dict().items() if not k.endswith("_per_pos")},
        }


@dataclass
class InFlight:
    block: DraftBlock
    payload: bytes
    worker: str | None  # the sticky worker it went to; None = the pool
    sent_at: float  # perf_counter
    sent_wall: float  # time.time
    speculation: Speculation | None = None


class DraftSession:
    def __init__(self, spec: SessionSpec, events: list[OutputEvent], *, drafter: Drafter | None,
                 speculative: SpeculativeSettings, cost: CostModel | None, reply_to: str,
                 pipelined: bool) -> None:
        self.spec = spec
        self.request_id = spec.request_id
        self.committed: list[int] = [*spec.prompt_ids, *(t for e in events for t in e.token_ids)]
        self.num_output = sum(len(e.token_ids) for e in events)
        self.round = len(events)
        self.resumed_from_round = self.round
        self.drafter = drafter if spec.route == "sd" else None
        self.controller = BlockLengthController(speculative, cost=cost)
        self.stats = events[-1].stats.copy() if events else SpecDecodingStats()
        self.sampling = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k,
                                       seed=spec.seed)
        self._streams: dict[int, torch.Generator] = {}  # round -> its draft stream (sampling)
        self.sticky_worker: str | None = None
        self.reply_to = reply_to
        self.pipelined = pipelined and self.drafter is not None
        self.transport_ms: list[float] = []
        self.first_token_at: float | None = None
        self.timing = DraftTiming()
        self.in_flight: InFlight | None = None
        self.finish_reason: str | None = None
        self._prepared: DraftBlock | None = None  # block k+1, drafted while block k was verified

    # --- blocks ---------------------------------------------------------------------------------
    def first_block(self) -> DraftBlock:
        return self._next_block()

    def _block_length(self, gamma: int | None = None, num_output: int | None = None) -> int:
        """gamma (default: the controller's) within the request's limits: a round emits up to gamma + 1
        tokens, and a degraded pool caps gamma."""
        if self.drafter is None:
            return 0
        gamma = self.controller.num_draft_tokens if gamma is None else gamma
        remaining = self.spec.max_new_tokens - (self.num_output if num_output is None else num_output)
        cap = self.spec.max_draft_tokens if self.spec.max_draft_tokens is not None else remaining
        return max(0, min(gamma, remaining - 1, cap))

    def _plain_rounds(self) -> int:
        """Target-only rounds the next block asks for (at least 1): the rest of the request on the plain
        route, else as long as the controller keeps drafting off."""
        remaining = max(1, self.spec.max_new_tokens - self.num_output)
        wanted = remaining if self.drafter is None else self.controller.num_plain_rounds
        return max(1, min(wanted, remaining, MAX_PLAIN_ROUNDS))

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

    def _next_block(self) -> DraftBlock:
        prepared, self._prepared = self._prepared, None
        if prepared is not None:
            return prepared
        num_draft_tokens = self._block_length()
        if num_draft_tokens <= 0:
            return self._make_block([], None, self._plain_rounds())
        started = time.perf_counter()
        proposal = self.drafter.propose(self.committed, num_draft_tokens, self.sampling, self._stream(self.round))
        self.timing.draft_s += time.perf_counter() - started
        if not proposal.token_ids:  # nothing to propose (no lookup match): one target-only round
            return self._make_block([], None)
        return self._make_block(proposal.token_ids, proposal.probs)

    def _stream(self, round_index: int) -> torch.Generator:
        """Round r's draft randomness: its own seeded stream, so the draft of a round is the same
        whether it was speculated during round r-1 or drafted after it."""
        if round_index not in self._streams:
            self._streams = {r: g for r, g in self._streams.items() if r >= round_index - 1}
            self._streams[round_index] = self.sampling.make_stream("draft", round_index)
        return self._streams[round_index]

    def sent(self, block: DraftBlock, payload: bytes, worker: str | None) -> None:
        self.in_flight = InFlight(block, payload, worker, time.perf_counter(), time.time())

    # --- pipelining -----------------------------------------------------------------------------
    def speculate(self, verdict_ready) -> None:
        """Draft block k+1 while block k is being verified (assuming k is accepted whole); stops as soon
        as verdict_ready() (any verdict waiting for this process) says so."""
        flight = self.in_flight
        if not self.pipelined or flight is None or flight.speculation is not None or not flight.block.draft_ids:
            return
        num_sent = len(flight.block.draft_ids)
        next_length = self._block_length(self.controller.after(num_sent, num_sent), self.num_output + num_sent + 1)
        speculation = speculate(self.drafter, self.committed, flight.block.draft_ids, next_length, self.sampling,
                                self._stream(self.round + 1), verdict_ready=verdict_ready,
                                guess_generator=self.sampling.make_stream("guess", self.round))
        if speculation is not None:
            flight.speculation = speculation
            self.timing.speculations += 1
            self.timing.speculation_s += speculation.elapsed_s

    def _top_up(self, speculation: Speculation, length: int) -> DraftBlock:
        """The speculated block, cut to `length` or completed on the critical path when the verdict
        cut the speculation short."""
        draft_ids = speculation.draft_ids[:length]
        probs = speculation.draft_probs[:length] if speculation.draft_probs is not None else None
        if len(draft_ids) < length:
            started = time.perf_counter()
            more = self.drafter.propose([*self.committed, *draft_ids], length - len(draft_ids), self.sampling,
                                        self._stream(self.round))
            self.timing.draft_s += time.perf_counter() - started
            draft_ids = [*draft_ids, *more.token_ids]
            if probs is not None and more.probs is not None:
                probs = torch.cat([probs, more.probs])
        return self._make_block(draft_ids, probs)

    # --- verdicts -------------------------------------------------------------------------------
    def on_verdict(self, verdict: Verdict, verdict_wall: float | None = None) -> DraftBlock | None:
        """Apply the verdict of the block in flight; the next block, or None when the request ended."""
        flight = self.in_flight
        assert flight is not None and verdict.round == self.round, "a verdict for another round"
        self.in_flight = None
        round_trip_s = time.perf_counter() - flight.sent_at
        speculation = flight.speculation
        if verdict.worker_id and verdict.verify_started_at:
            # transport = round trip - time in the verify worker - the time the verdict sat unread while
            # we were still speculating (wall clocks of two hosts: a small skew stays in the figure)
            unread_s = max(0.0, speculation.finished_at - verdict.verify_finished_at) if speculation else 0.0
            in_worker_s = verdict.verify_finished_at - max(verdict.verify_started_at, flight.sent_wall)
            self.transport_ms.append(1000 * max(0.0, round_trip_s - max(0.0, in_worker_s) - unread_s))
        self.committed.extend(verdict.committed_ids)
        self.num_output = verdict.num_committed - len(self.spec.prompt_ids)
        if verdict.committed_ids and self.first_token_at is None:
            self.first_token_at = time.time()
        self.stats = verdict.stats
        self.controller.observe_load(verdict.batch_rows)
        if verdict.num_draft_tokens or flight.block.draft_ids:
            self.controller.update(verdict.num_draft_tokens, verdict.num_accepted)
        for _ in range(verdict.num_rounds - (1 if flight.block.draft_ids else 0)):
            self.controller.update(0, 0)
        self.sticky_worker = verdict.worker_id or self.sticky_worker
        self.round += verdict.num_rounds
        if verdict.finished:
            self.finish_reason = verdict.finish_reason or "stop"
            return None
        if speculation is not None and verdict.num_rounds == 1 and \
                speculation_holds(speculation, len(flight.block.draft_ids), verdict):
            length = self._block_length()
            if length > 0 and speculation.draft_ids:
                self._prepared = self._top_up(speculation, length)
                self.timing.speculation_hits += 1
                self.timing.hidden_s += hidden_seconds(speculation, flight.sent_wall, verdict.verify_finished_at)
        if self._prepared is None:
            self._streams.pop(self.round, None)  # a dropped speculation used this round's stream: start it over
        return self._next_block()

    # --- the end --------------------------------------------------------------------------------
    def summary(self) -> SessionSummary:
        return SessionSummary(self.request_id, self.finish_reason or "length", self.num_output, self.round,
                              self.stats, self.transport_ms, self.first_token_at, self.resumed_from_round,
                              self.timing)

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
