"""One session, driven from the draft side: draft a block, send it, apply the verdict, adapt gamma.

Hot path per round: one RPUSH of the block, one BLPOP of the verdict
(msgpack over Redis lists). Between the two, the next block is drafted on
the assumption that this one is accepted whole (draft_worker/pipeline.py). A session resumes from its output stream, so a
redelivered task (dead draft worker) continues where the last one stopped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis
import torch

from services import protocol
from services.config import Settings
from draft_worker.pipeline import (
    DraftTiming,
    Speculation,
    hidden_seconds,
    speculate,
    speculation_holds,
)
from services.models.drafters import DraftSource
from services.protocol import DraftBlock, OutputEvent, SessionSpec, Verdict
from services.redis_client import RoundCommitter, read_heartbeats
from services.speculative.block_length import BlockLengthController
from services.speculative.cost_model import CostModel
from services.speculative.sampling import SamplingParams
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)

LEASE_TTL_S = 10
COST_REFRESH_S = 10.0


class SessionFailed(RuntimeError):
    """The session cannot go on (no verify worker answered in time, spec missing)."""


@dataclass
class DraftRuntime:
    """What a draft worker process loads once and shares across its sessions."""

    settings: Settings
    client: redis.Redis
    draft_source: DraftSource
    worker_id: str
    db: object = None  # sessionmaker for SQL records; None = no records
    profile: dict = field(default_factory=dict)  # measured at start-up: draft_ms_per_token
    committer: RoundCommitter = field(init=False)
    _costs: dict = field(default_factory=dict, init=False)  # pool -> (read at, CostModel | None)

    def __post_init__(self) -> None:
        self.committer = RoundCommitter(self.client)

    def cost_model(self, pool: str) -> CostModel | None:
        """For block_policy "cost": the pool's verify cost curve (its workers' start-up profiles, averaged)
        and this worker's draft cost; re-read at most every COST_REFRESH_S."""
        if self.settings.speculative.block_policy != "cost":
            return None
        read_at, cost = self._costs.get(pool, (float("-inf"), None))
        if time.monotonic() - read_at < COST_REFRESH_S:
            return cost
        curves = [beat.profile for beat in read_heartbeats(self.client)
                  if beat.role == "verify" and beat.pool == pool and beat.profile]
        merged = {key: sum(curve[key] for curve in curves if key in curve) / sum(key in c for c in curves)
                  for key in {key for curve in curves for key in curve if key.startswith("verify_ms_")}}
        cost = CostModel.from_profile(merged, self.profile.get("draft_ms_per_token", 0.0)) if merged else None
        self._costs[pool] = (time.monotonic(), cost)
        return cost


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
class _Sent:
    worker: str | None  # the sticky worker it went to; None = the pool
    payload: bytes
    at: float  # perf_counter


class DraftSession:
    def __init__(self, runtime: DraftRuntime, spec: SessionSpec, events: list[OutputEvent]) -> None:
        self.runtime = runtime
        self.client = runtime.client
        self.spec = spec
        self.request_id = spec.request_id
        self.committed: list[int] = [*spec.prompt_ids, *(t for e in events for t in e.token_ids)]
        self.num_output = sum(len(e.token_ids) for e in events)
        self.round = len(events)
        self.resumed_from_round = self.round
        speculative = runtime.settings.speculative
        self.drafter = runtime.draft_source.new_drafter() if spec.route == "sd" else None
        self.controller = BlockLengthController(speculative, cost=runtime.cost_model(spec.pool))
        self.stats = SpecDecodingStats()
        self.sampling = SamplingParams(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, seed=spec.seed)
        self._streams: dict[int, torch.Generator] = {}  # round -> its draft stream (sampling)
        self.sticky_worker: str | None = None
        self.transport_ms: list[float] = []
        self.first_token_at: float | None = None
        self.reply_to = protocol.verdict_queue(self.request_id)
        self.pipelined = runtime.settings.worker.pipelined_drafting and self.drafter is not None
        self.timing = DraftTiming()
        self._prepared: DraftBlock | None = None  # block k+1, drafted while block k was verified

    # --- the loop -------------------------------------------------------------------------------
    def run(self, report: Callable[[dict], None] | None = None) -> SessionSummary:
        self.client.delete(self.reply_to)  # verdicts of an earlier owner are stale
        finish_reason = "length"
        lease_renewed = time.monotonic()
        try:
            while True:
                if self.client.exists(protocol.cancel_key(self.request_id)):
                    finish_reason = self._cancel()
                    break
                verdict = self._round()
                if verdict.finished:
                    finish_reason = verdict.finish_reason or "stop"
                    break
                if report is not None and self.round % 8 == 0:
                    report(self._progress())
                if time.monotonic() - lease_renewed > LEASE_TTL_S / 4:  # off the per-round path
                    self.client.set(protocol.lease_key(self.request_id), self.runtime.worker_id, ex=LEASE_TTL_S)
                    lease_renewed = time.monotonic()
        finally:
            if self.drafter is not None:
                self.drafter.release()
        return SessionSummary(self.request_id, finish_reason, self.num_output, self.round, self.stats,
                              self.transport_ms, self.first_token_at, self.resumed_from_round, self.timing)

    def _block_length(self, gamma: int | None = None, num_output: int | None = None) -> int:
        """gamma (default: the controller's) within the request's limits: a round emits up to gamma + 1
        tokens, and a degraded pool caps gamma."""
        if self.drafter is None:
            return 0
        gamma = self.controller.num_draft_tokens if gamma is None else gamma
        remaining = self.spec.max_new_tokens - (self.num_output if num_output is None else num_output)
        cap = self.spec.max_draft_tokens if self.spec.max_draft_tokens is not None else remaining
        return max(0, min(gamma, remaining - 1, cap))

    def _make_block(self, draft_ids: list[int], probs) -> DraftBlock:
        return DraftBlock(
            request_id=self.request_id,
            round=self.round,
            num_committed=len(self.committed),
            draft_ids=draft_ids,
            draft_probs=protocol.encode_probs(probs) if probs is not None else None,
            vocab_size=int(probs.shape[-1]) if probs is not None else 0,
            reply_to=self.reply_to,
        )

    def _draft_block(self) -> DraftBlock:
        num_draft_tokens = self._block_length()
        if num_draft_tokens <= 0:
            return self._make_block([], None)
        started = time.perf_counter()
        proposal = self.drafter.propose(self.committed, num_draft_tokens, self.sampling, self._stream(self.round))
        self.timing.draft_s += time.perf_counter() - started
        return self._make_block(proposal.token_ids, proposal.probs)

    def _speculate(self, block: DraftBlock) -> Speculation | None:
        """Draft block k+1 while block k is being verified (assuming k is accepted whole)."""
        if not self.pipelined or not block.draft_ids:
            return None
        num_sent = len(block.draft_ids)
        next_length = self._block_length(self.controller.after(num_sent, num_sent), self.num_output + num_sent + 1)
        speculation = speculate(self.drafter, self.committed, block.draft_ids, next_length, self.sampling,
                                self._stream(self.round + 1), verdict_ready=lambda: self.client.llen(self.reply_to) > 0,
                                guess_generator=self.sampling.make_stream("guess", self.round))
        if speculation is not None:
            self.timing.speculations += 1
            self.timing.speculation_s += speculation.elapsed_s
        return speculation

    def _stream(self, round_index: int) -> torch.Generator:
        """Round r's draft randomness: its own seeded stream, so the draft of a round is the same
        whether it was speculated during round r-1 or drafted after it."""
        if round_index not in self._streams:
            self._streams = {r: g for r, g in self._streams.items() if r >= round_index - 1}
            self._streams[round_index] = self.sampling.make_stream("draft", round_index)
        return self._streams[round_index]

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

    def _round(self) -> Verdict:
        block, self._prepared = self._prepared or self._draft_block(), None
        sent_at = time.time()
        sent = self._send(block)
        speculation = self._speculate(block)  # runs while the verify worker checks `block`
        verdict, round_trip_s = self._await_verdict(block, sent)
        # transport = round trip - verify time - the time the verdict sat unread while we were still
        # speculating (wall clocks of two hosts: a small skew stays in the figure)
        unread_s = max(0.0, speculation.finished_at - verdict.verify_finished_at) if speculation else 0.0
        self.transport_ms.append(
            1000 * max(0.0, round_trip_s - (verdict.verify_finished_at - verdict.verify_started_at) - unread_s)
        )
        self.committed.extend(verdict.committed_ids)
        self.num_output = verdict.num_committed - len(self.spec.prompt_ids)
        if verdict.committed_ids and self.first_token_at is None:
            self.first_token_at = time.time()
        self.stats.observe(verdict.num_draft_tokens, verdict.num_accepted)
        self.controller.update(verdict.num_draft_tokens, verdict.num_accepted)
        self.sticky_worker = verdict.worker_id or None
        self.round += 1
        if speculation is not None and speculation_holds(speculation, len(block.draft_ids), verdict):
            length = self._block_length()
            if length > 0 and speculation.draft_ids:
                self._prepared = self._top_up(speculation, length)
                self.timing.speculation_hits += 1
                self.timing.hidden_s += hidden_seconds(speculation, sent_at, verdict.verify_finished_at)
        if self._prepared is None:
            self._streams.pop(self.round, None)  # a dropped speculation used this round's stream: start it over
        return verdict

    def _send(self, block: DraftBlock) -> "_Sent":
        """RPUSH the block to the sticky worker (the pool when none is known yet)."""
        worker = self.sticky_worker
        queue = protocol.verify_worker_queue(worker) if worker else protocol.verify_pool_queue(self.spec.pool)
        payload = block.encode()
        sent = _Sent(worker, payload, time.perf_counter())
        self.client.rpush(queue, payload)
        return sent

    def _await_verdict(self, block: DraftBlock, sent: "_Sent") -> tuple[Verdict, float]:
        """Wait for the block's verdict, failing over to the pool when the worker holding the
        session stops sending heartbeats; returns the verdict and the round trip in seconds."""
        # No liveness check per round: a dead sticky worker shows up as a wait
        # without a verdict, and the block then goes to the pool.
        worker = sent.worker
        deadline = time.monotonic() + self.runtime.settings.worker.verdict_timeout_s
        while time.monotonic() < deadline:
            item = self.client.blpop([self.reply_to], timeout=0.5)
            if item is not None:
                verdict = Verdict.decode(item[1])
                if verdict.round == block.round:
                    return verdict, time.perf_counter() - sent.at
                logger.debug("request %s: stale verdict for round %d dropped", self.request_id, verdict.round)
                continue
            if worker is not None and not self._alive(worker):
                logger.warning("request %s: verify worker %s is gone; resending round %d to pool %s",
                               self.request_id, worker, block.round, self.spec.pool)
                worker = None
                self.client.rpush(protocol.verify_pool_queue(self.spec.pool), sent.payload)
        raise SessionFailed(f"no verify worker answered round {block.round} of {self.request_id} "
                            f"within {self.runtime.settings.worker.verdict_timeout_s:.0f}s")

    def _alive(self, worker_id: str) -> bool:
        return bool(self.client.exists(protocol.heartbeat_key(worker_id)))

    def _cancel(self) -> str:
        """Close the stream with a 'cancelled' event and free the verify side's KV cache."""
        stream = protocol.output_stream(self.request_id)
        seq = int(self.client.xlen(stream))
        event = OutputEvent(request_id=self.request_id, seq=seq, token_ids=[], num_output_tokens=self.num_output,
                            finished=True, finish_reason="cancelled", num_drafts=self.stats.num_drafts,
                            num_draft_tokens=self.stats.num_draft_tokens,
                            num_accepted_tokens=self.stats.num_accepted_tokens)
        self.runtime.committer.commit(stream_key=stream, verdict_key=self.reply_to, expected_seq=seq,
                                      event=event.encode(), verdict=b"")
        release = DraftBlock(request_id=self.request_id, round=self.round, num_committed=len(self.committed),
                             draft_ids=[], release=True)
        queue = (protocol.verify_worker_queue(self.sticky_worker) if self.sticky_worker
                 else protocol.verify_pool_queue(self.spec.pool))
        self.client.rpush(queue, release.encode())
        return "cancelled"

    def _progress(self) -> dict:
        return {
            "request_id": self.request_id,
            "tokens": self.num_output,
            "rounds": self.round,
            "acceptance_rate": self.stats.acceptance_rate,
            "mean_acceptance_length": self.stats.mean_acceptance_length,
            "num_draft_tokens": self.controller.num_draft_tokens,
        }
