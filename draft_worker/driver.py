"""The draft worker's engine room: one thread drives every session of the process.
(Over 300 lines: one loop's intake, drafting, sends, verdicts and failover, sharing its per-session state.)

Celery tasks (the control path: acks, redelivery, progress states) hand their
session to the driver and wait for it to end; the driver does the hot path
for all of them at once:

- verdicts of every session arrive on one Redis list, this process's inbox,
  which a listener thread keeps a blocking pop on (draft_worker/inbox.py):
  the driver finds them without a round trip, so a round costs it one, the
  push of its blocks;
- each verdict is applied; the next blocks of every session answered in this
  turn are drafted together (a model draft steps all of them in one forward
  per draft position) or taken from their speculation, and all go out in one
  pipeline, pushed by the outbox thread (draft_worker/outbox.py) while the
  driver drafts on: the push's round trip over a slow link is not the
  driver's wait;
- while blocks are out and no verdict waits, every session's next block is
  speculated (pipelined drafting), again stepped together, yielding to the
  first verdict that arrives (a look at the listener's arrivals, no poll);
- a speculated block goes out at once, chained to the block before it, while
  the session has fewer than `blocks_ahead` blocks out (from the measured
  Redis RTT and verify time by default): its verify worker goes on with it as
  soon as the one before is accepted whole, and the link's trip is off the
  round (services/speculative/chaining.py);
- every CONTROL_EVERY_S: cancellations, failover (a block whose verify
  worker stopped heartbeating goes to the pool, and so does a block that
  left the pool's queue without any worker saying it took it), a block
  unanswered for RESEND_AFTER_S by a live worker, and no longer in its
  queue, sent to it again (a lost message must not hold a request until its
  deadline), and verdict
  deadlines (the session ends with an error event in its stream). The
  look at every session's cancel and request keys, and the look at suspect
  verify workers' heartbeats, ride in the pipeline of a turn's blocks, and
  their replies come back through the outbox: the driver waits on neither.
  The cancellation look takes a round trip of its own only when no block
  has gone for LOOK_ALONE_AFTER_S (slow rounds, a stalled verify pool).

The driver counts its round trips to Redis, by what each was for
(services/link/meter.py), so the heartbeat reports them per verdict: one
while blocks flow, and a little more for the blocks sent ahead that a
rejection of their parent dropped.

So a process drives hundreds of sessions; prompt lookup costs about nothing
per block, and a model draft's cost is the only limit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from services.engine.draft_pipeline import SpeculationState, prefill, speculate_many, warm_up
from services.engine.draft_session import DraftSession, InFlight, SessionSummary
from services import protocol
from draft_worker.inbox import InboxListener
from draft_worker.outbox import Job, Outbox
from services.link.meter import (TRIP_CATCH_UP, TRIP_CLOSE, TRIP_FAILOVER, TRIP_LIVENESS, TRIP_LOOK, TRIP_RECOVERY,
                                 TRIP_RESEND, LinkMeter, smoothed)
from services.models.drafters.base import DraftProposal
from services.models.drafters.batched import propose_many
from services.protocol import BlockTaken, DraftBlock, OutputEvent, ProtocolError, Verdict, decode_one_of
from services.redis_client import RoundCommitter, decode_all
from services.speculative.chaining import blocks_ahead

logger = logging.getLogger(__name__)

CONTROL_EVERY_S = 0.2  # cancellations, liveness of verify workers, deadlines
LOOK_ALONE_AFTER_S = 1.0  # the cancellation look goes alone when no block has carried it this long
FAILOVER_AFTER_S = 0.5  # a block out this long makes the driver look at its verify worker's heartbeat
# ... at most this often (and at the pool's queue for an untaken block): a heartbeat key lives heartbeat_ttl_s (3 s)
# past its worker's death, so a look every control tick (0.2 s) found nothing sooner, and on a slow verifier
# (rounds of 0.7-6 s on a loaded 2-core EPYC) those looks made 4.4 round trips a round over a 20 ms link
LIVENESS_EVERY_S = 1.0
# A block sent to the pool that no worker has said it took (BlockTaken) for this long, and that is no longer in the
# pool's queue, was popped by a worker that died before it could say so: it goes to the pool again.
UNTAKEN_AFTER_S = 2.0
# A block taken by a live verify worker, unanswered this long (then again each time as long) and no longer in that
# worker's queue (a busy worker's queued block is only waiting), is sent to that worker again: whatever dropped it,
# the copy is answered as any block is (a duplicate of the block in hand is ignored, one whose rounds are committed
# gets a resync verdict, one the worker lost rebuilds its session from the stream), so a resend can never commit
# twice, and a lost message costs seconds, not the verdict deadline. Well above a round under load on a CPU box (a
# chaos drill on 2 cores saw 8 concurrent rounds wait 5-10 s behind prefills and kills): a resend says "look here".
RESEND_AFTER_S = 15.0
IDLE_WAIT_S = 0.5
MAX_CATCH_UP_ROUNDS = 1024  # stream entries read back at most for a session bridged while its draft prefilled


class SessionFailed(RuntimeError):
    """The session cannot go on (no verify worker answered in time)."""


@dataclass
class SessionHandle:
    """What a Celery task holds while the driver runs its session."""

    session: DraftSession
    done: threading.Event = field(default_factory=threading.Event)
    summary: SessionSummary | None = None
    error: str | None = None


class SessionDriver(threading.Thread):
    def __init__(self, *, client: redis.Redis, worker_id: str, verdict_timeout_s: float,
                 blocks_ahead: int = 0, prefill_after_opening: bool = False) -> None:
        super().__init__(daemon=True, name="draft-driver")
        self.client = client
        self.worker_id = worker_id
        self.inbox = protocol.draft_inbox(worker_id)
        self.verdict_timeout_s = verdict_timeout_s
        self.blocks_ahead_setting = blocks_ahead  # WorkerSettings.blocks_ahead: 0 = from the link
        self.prefill_after_opening = prefill_after_opening  # SpeculativeSettings.draft_prefill == "after_opening"
        self._verify_ms: float | None = None  # smoothed verify time of the rounds (for the depth)
        self._draft_step_ms: float | None = None  # smoothed wall time of one batched draft step (the same)
        self.committer = RoundCommitter(client)
        self._handles: dict[str, SessionHandle] = {}
        self._incoming: list[SessionHandle] = []
        # Sessions whose next block is due: kept here until it is sent, so an error anywhere in a turn
        # (Redis gone for a moment) delays them instead of forgetting them.
        self._due: dict[str, SessionHandle] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self.stopping = threading.Event()
        self._controlled = 0.0
        self._looked = 0.0
        self._liveness_looked = 0.0  # perf_counter of the last look at suspect verify workers' heartbeats
        self._liveness_out = False  # that look's replies have not come back yet
        self.num_verdicts = 0
        self.num_turns = 0  # a driver with nothing to do waits on its inbox: this stays low while it does
        self.meter = LinkMeter()  # round trips and transport of the rounds; the heartbeat adds Redis RTT
        self.listener = InboxListener(client, self.inbox, self._wake, self.stopping)
        self.outbox = Outbox(client, self._wake, self.stopping, self.meter.count_round_trip)

    # --- called from task threads ---------------------------------------------------------------
    def submit(self, session: DraftSession) -> SessionHandle:
        handle = SessionHandle(session)
        with self._lock:
            self._incoming.append(handle)
        self._wake.set()
        return handle

    @property
    def num_sessions(self) -> int:
        return len(self._handles) + len(self._incoming)

    # --- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        logger.info("draft driver %s: verdicts on %s", self.worker_id, self.inbox)
        self.listener.start()
        self.outbox.start()
        backoff = 0.0  # > 0 while Redis is away
        while not self.stopping.is_set():
            try:
                self.turn()
                if backoff:
                    backoff = 0.0
                    self._resend_in_flight()
            except redis.RedisError as exc:
                backoff = min(2.0, max(0.1, backoff * 2))
                logger.warning("draft driver: Redis error (%s); retrying in %.1fs", exc, backoff)
                time.sleep(backoff)
            except Exception:  # the process boundary: keep driving the other sessions
                logger.exception("draft driver: unexpected error")
                time.sleep(0.1)

    def _resend_in_flight(self) -> None:
        """After a Redis outage a block or its verdict may be gone (a restart loses the last writes even with
        AOF): send every block still out once more. A verify worker answers a round it already committed with
        a resync verdict, so a resend can never commit twice."""
        waiting = [h for h in self._handles.values() if h.session.in_flight is not None]
        if not waiting:
            return
        self.outbox.flush()
        with self.client.pipeline(transaction=False) as pipe:
            for handle in waiting:
                handle.session.drop_ahead()
                flight = handle.session.in_flight
                queue = protocol.verify_worker_queue(flight.worker) if flight.worker \
                    else protocol.verify_pool_queue(handle.session.spec.pool)
                pipe.rpush(queue, flight.payload)
                flight.sent_at = time.perf_counter()
            self._execute(pipe, TRIP_RECOVERY)
        self._liveness_out = False  # its look failed with the outage, or comes back to flights already resent
        logger.info("draft driver: Redis is back; re-sent %d blocks in flight", len(waiting))

    def turn(self) -> None:
        self.num_turns += 1
        self._start_new()
        self._take_outcomes()
        arrivals = self._take_verdicts(wait=not self._due and not self._speculation_pending()
                                       and not self._chain_ready())
        seen_at = time.perf_counter()
        for raw, arrived_at in arrivals:
            try:  # held: how long the verdict waited here on the driver's other work
                self._on_verdict(raw, seen_at, held_s=seen_at - arrived_at)
            except Exception:  # a verdict this side cannot apply: that session fails, the others go on
                logger.exception("draft driver: could not apply a verdict")
        now = time.monotonic()
        look = list(self._handles.values()) if now - self._looked >= CONTROL_EVERY_S else []
        jobs = []  # one pipeline: this turn's blocks, and the reads riding with them (or going alone)
        if now - self._controlled >= CONTROL_EVERY_S:
            self._controlled = now
            jobs += self._watch_flights()
        blocks = self._blocks_job(self._next_blocks())
        # the cancellation look rides with blocks, or with a liveness look (one round trip for both while nothing
        # else goes, as in a long opening), or goes alone once no block has gone for LOOK_ALONE_AFTER_S
        if look and (blocks is not None or jobs or now - self._looked >= LOOK_ALONE_AFTER_S):
            jobs.append(self._look_job(look))
            self._looked = now  # its flags come back through the outbox (_take_outcomes)
        self.outbox.send(*([blocks] if blocks is not None else []), *jobs)
        self._speculate()

    def _start_new(self) -> None:
        with self._lock:
            incoming, self._incoming = self._incoming, []
        for handle in incoming:
            self._handles[handle.session.request_id] = handle
            if handle.session.in_flight is None:  # else its first block is out (the gateway sent round 0)
                self._due[handle.session.request_id] = handle

    @property
    def blocks_ahead(self) -> int:
        """Blocks each session may keep out (services/speculative/chaining.py)."""
        return blocks_ahead(self.blocks_ahead_setting, self.meter.redis_rtt_ms, self._verify_ms, self._drafting_ms())

    def _drafting_ms(self) -> float | None:
        """The wall time of drafting a block and its bonus guess: the longest block in flight, plus one, at the
        batched draft step the driver last timed (None before it timed one). Asked every turn: it reads what was
        sent, not the controllers' next choice (a cost-model search per session)."""
        if self._draft_step_ms is None:
            return None
        flights = [handle.session.in_flight for handle in tuple(self._handles.values())]  # one copy: other threads ask
        longest = max((len(flight.block.draft_ids) for flight in flights if flight is not None), default=0)
        return self._draft_step_ms * (longest + 1)

    def _chained_blocks(self) -> list[tuple[SessionHandle, DraftBlock]]:
        """Speculated blocks ready to go ahead of their parents' verdicts."""
        depth = self.blocks_ahead
        blocks = []
        for handle in self._handles.values():
            if handle.session.in_flight is not None:
                handle.session.blocks_ahead = depth
                block = handle.session.chained_block()
                if block is not None:
                    blocks.append((handle, block))
        return blocks

    def _chain_ready(self) -> bool:
        depth = self.blocks_ahead
        return depth > 1 and any(h.session.in_flight is not None and h.session.ahead_ready(depth)
                                 for h in self._handles.values())

    def _next_blocks(self) -> list[tuple[SessionHandle, DraftBlock]]:
        """Every due session's next block, the drafting of all of them in one batched call (a model draft
        steps them together: services/models/drafters/batched.py), and the blocks that go ahead of their
        parents' verdicts. A session whose drafting fails ends with an error; the others are drafted again
        one by one."""
        due = [handle for handle in self._due.values() if handle.session.in_flight is None]
        if not due:
            return self._chained_blocks()
        late = [handle for handle in due if handle.session.catching_up]
        if late and self.prefill_after_opening:
            self._catch_up(late)
        calls = [(handle, handle.session.draft_call()) for handle in due]
        wanted = [(handle, call) for handle, call in calls if call is not None]
        proposals: dict[int, tuple[DraftProposal, float]] = {}
        if wanted:
            started = time.perf_counter()
            try:
                drafted = propose_many([call for _, call in wanted])
            except Exception:
                logger.exception("draft driver: batched drafting failed; drafting session by session")
                drafted = [self._draft_alone(handle, call) for handle, call in wanted]
            elapsed = time.perf_counter() - started
            total = sum(len(proposal.token_ids) for proposal in drafted if proposal is not None) or 1
            longest = max((len(proposal.token_ids) for proposal in drafted if proposal is not None), default=0)
            if longest:  # a block waits for the whole batched call, one step a token
                self._draft_step_ms = smoothed(self._draft_step_ms, 1000 * elapsed / longest)
            for (handle, _), proposal in zip(wanted, drafted):  # the batch's time, shared by tokens drafted
                if proposal is not None:
                    proposals[id(handle)] = (proposal, elapsed * len(proposal.token_ids) / total)
        blocks = []
        for handle in due:
            if handle.session.request_id not in self._handles:  # its drafting failed: already finished
                continue
            blocks.append((handle, handle.session.next_block(*proposals.get(id(handle), (None, 0.0)))))
        return blocks + self._chained_blocks()

    def _catch_up(self, handles: list[SessionHandle]) -> None:
        """Sessions whose draft prefills after their opening's verdict: the verify worker decoded them on its own
        meanwhile (bridging). The prompts of those that will draft (not target-only rounds at this load) are
        prefilled first (batched), then the rounds committed since are
        read from their streams (one pipeline) and taken as committed: the first block is drafted from there,
        and is not answered unverified for a bridge that went past it."""
        prefill([(handle.session.drafter, handle.session.committed) for handle in handles
                 if handle.session.drafter is not None and handle.session.will_draft])
        with self.client.pipeline(transaction=False) as pipe:
            for handle in handles:  # one token a bridged round: no more rounds than tokens left to the request
                left = handle.session.spec.max_new_tokens - handle.session.num_output
                pipe.xrevrange(protocol.output_stream(handle.session.request_id),
                               count=max(1, min(MAX_CATCH_UP_ROUNDS, left)))
            replies = self._execute(pipe, TRIP_CATCH_UP)
        for handle, entries in zip(handles, replies):  # a bad entry is skipped: catch_up stops at the gap
            handle.session.catch_up(decode_all(OutputEvent, [fields.get(b"m") for _, fields in entries],
                                               "output event"))

    def _draft_alone(self, handle: SessionHandle, call) -> DraftProposal | None:
        try:
            return propose_many([call])[0]
        except Exception as exc:
            logger.exception("request %s: drafting failed", handle.session.request_id,
                             extra={"request_id": handle.session.request_id})
            self._fail(handle, f"drafting failed: {type(exc).__name__}: {exc}")
            return None

    def _take_verdicts(self, wait: bool) -> list[tuple[bytes, float]]:
        """What the listener has popped (message, arrival), waiting for some when `wait` and nothing has come:
        until a verdict arrives or a task submits a session, at most until the next control look."""
        arrivals = self.listener.take()
        if arrivals or not wait:
            return arrivals
        self._wake.wait(CONTROL_EVERY_S if self._handles else IDLE_WAIT_S)
        self._wake.clear()  # then take: whatever arrived before the clear is taken now, later ones set it again
        return self.listener.take()

    def _on_verdict(self, raw: bytes, seen_at: float | None = None, held_s: float = 0.0) -> None:
        try:
            message = decode_one_of(raw, (Verdict, BlockTaken))
        except ProtocolError as exc:
            logger.warning("dropped a bad message in the inbox: %s", exc)
            return
        handle = self._handles.get(message.request_id)
        session = handle.session if handle else None
        if isinstance(message, BlockTaken):  # the pool's worker that has the block: watch its heartbeat
            if session is not None and session.in_flight is not None and message.round == session.round:
                session.in_flight.worker = session.sticky_worker = message.worker_id
            return
        verdict = message
        self.num_verdicts += 1
        self.meter.observe_verdict()
        if session is None or session.in_flight is None or verdict.round != session.round or (
                verdict.block_id and verdict.block_id != session.in_flight.block.block_id):
            logger.debug("stale verdict for %s round %d dropped", verdict.request_id, verdict.round,
                         extra={"request_id": verdict.request_id})
            return
        try:
            finished = session.on_verdict(verdict, draft_sessions=len(self._handles), seen_at=seen_at,
                                          held_s=held_s)
        except Exception as exc:
            self._fail(handle, f"could not apply the verdict of round {verdict.round}: {exc}")
            raise
        if session.last_trip is not None or session.last_chained:
            self.meter.observe_round(session.last_trip, chained=session.last_chained)
        if session.last_trip is not None:
            self._verify_ms = smoothed(self._verify_ms, session.last_trip.verify_ms)
        if finished:
            self._finish(handle)
        elif session.in_flight is None:  # else the verify worker is on the block sent after this one
            self._due[session.request_id] = handle

    def _execute(self, pipe, kind: str) -> list:
        self.meter.count_round_trip(kind)
        return pipe.execute()

    def _blocks_job(self, outgoing: list[tuple[SessionHandle, DraftBlock]]) -> Job | None:
        """An RPUSH of every block to its session's sticky verify worker (the pool when none is known), for the
        outbox. The blocks count as sent from now on. None when there is no block."""
        if not outgoing:
            return None
        pushes = []
        sent_at, sent_wall = time.perf_counter(), time.time()  # the round trip starts with the push
        for handle, block in outgoing:
            session = handle.session
            # a chained block goes where its parent is; the others to the sticky worker
            worker = session.in_flight.worker if block.parent_id else session.sticky_worker
            queue = protocol.verify_worker_queue(worker) if worker else protocol.verify_pool_queue(
                session.spec.pool)
            payload = block.encode()
            pushes.append((queue, payload))
            session.sent(block, payload, worker, sent_at, sent_wall)
            self._due.pop(session.request_id, None)
        return Job(pushes)

    def _look_job(self, handles: list[SessionHandle]) -> Job:
        """The control look at every session's cancel and request keys (_apply_look)."""
        reads = [("EXISTS", key) for handle in handles for key in (protocol.cancel_key(handle.session.request_id),
                                                                    protocol.request_key(handle.session.request_id))]
        return Job(reads=reads, on_replies=lambda flags: self._apply_look(handles, flags), alone=TRIP_LOOK)

    def _take_outcomes(self) -> None:
        """The outbox's news: control looks to apply; a failed push (Redis away) raises here, so the loop
        backs off and then sends every block in flight again."""
        failed = None
        for outcome in self.outbox.outcomes():
            if outcome.error is not None:
                failed = outcome.error
                if outcome.job.alone == TRIP_LIVENESS:
                    self._liveness_out = False
            outcome.apply()
        if failed is not None:
            raise failed if isinstance(failed, redis.RedisError) else redis.ConnectionError(str(failed))

    def _speculations(self) -> list[SpeculationState]:
        """The speculations to step: every session's, but with draft_prefill "after_opening" a session in its
        opening round waits for its verdict unless another session keeps the draft busy (then the verify worker
        runs on its own cores anyway, and the prefill costs nobody a core)."""
        sessions = [handle.session for handle in self._handles.values()]
        if self.prefill_after_opening and not any(s.keeps_the_draft_busy and not s.in_opening for s in sessions):
            sessions = [session for session in sessions if not session.in_opening]
        for session in sessions:
            if session.in_opening:  # no verdict has told it the load yet
                session.observe_draft_sessions(len(self._handles))
        states = (session.speculation() for session in sessions)
        return [state for state in states if state is not None and not state.done]

    def _speculation_pending(self) -> bool:
        return bool(self._speculations())

    def _speculate(self) -> None:
        """Pipelined drafting for the blocks in flight, every session's speculation stepped together,
        until any verdict arrives."""
        states = warm_up(self._speculations())
        if states:
            for step_s in speculate_many(states, self.listener.pending):  # a look at what arrived: no round trip
                self._draft_step_ms = smoothed(self._draft_step_ms, 1000 * step_s)

    # --- control path ---------------------------------------------------------------------------
    def _apply_look(self, handles: list[SessionHandle], flags: list) -> None:
        """Cancellations and lost requests, from a look at every session's cancel and request keys."""
        for handle, cancelled, known in zip(handles, flags[::2], flags[1::2]):
            if handle.session.request_id not in self._handles:  # finished since the look
                continue
            if not known:  # Redis lost the request (restarted without its data): nobody waits for it
                self._finish(handle, error=f"request {handle.session.request_id} was lost by Redis")
            elif cancelled:
                self._cancel(handle)

    def _watch_flights(self) -> list[Job]:
        """Deadlines of the blocks out; and, at most every LIVENESS_EVERY_S, a look (returned, for the outbox) at
        the heartbeats of the verify workers holding blocks out long, and at the pool's queue for blocks no
        worker said it took: its replies fail over and resend (_on_liveness) on a later turn, so the driver
        waits on no round trip for it, and the look rides with the turn's blocks when there are any."""
        now = time.perf_counter()
        waiting = [h for h in self._handles.values() if h.session.in_flight is not None]
        for handle in waiting:
            if now - handle.session.in_flight.sent_at > self.verdict_timeout_s:
                self._fail(handle, f"no verify worker answered round {handle.session.round} of "
                           f"{handle.session.request_id} within {self.verdict_timeout_s:.0f}s")
        if self._liveness_out or now - self._liveness_looked < LIVENESS_EVERY_S:
            return []
        waiting = [(h, h.session.in_flight) for h in waiting if h.session.in_flight is not None]
        suspects = sorted({flight.worker for _, flight in waiting
                           if flight.worker and now - flight.sent_at > FAILOVER_AFTER_S})
        untaken = [(h, flight) for h, flight in waiting
                   if not flight.worker and now - flight.sent_at > UNTAKEN_AFTER_S]
        if not suspects and not untaken:
            return []
        self._liveness_looked, self._liveness_out = now, True
        reads = [("EXISTS", protocol.heartbeat_key(worker)) for worker in suspects]
        reads += [("LPOS", protocol.verify_pool_queue(h.session.spec.pool), flight.payload) for h, flight in untaken]
        return [Job(reads=reads, alone=TRIP_LIVENESS,
                    on_replies=lambda replies: self._on_liveness(suspects, untaken, waiting, replies, now))]

    def _on_liveness(self, suspects: list[str], untaken: list[tuple[SessionHandle, InFlight]],
                     looked: list[tuple[SessionHandle, InFlight]], replies: list, looked_at: float) -> None:
        """A liveness look's replies: blocks of workers whose heartbeat is gone go to the pool, and so do blocks
        out of the pool's queue that no worker said it took; blocks at live workers may be resent. Only flights
        still out as they were at the look are touched (a verdict or a BlockTaken may have come since)."""
        self._liveness_out = False
        alive = dict(zip(suspects, replies))
        current = [(h, flight) for h, flight in looked
                   if h.session.request_id in self._handles and h.session.in_flight is flight]
        for handle, flight in current:
            if flight.worker in alive and not alive[flight.worker]:
                self._fail_over(handle)
        for (handle, flight), position in zip(untaken, replies[len(suspects):]):
            # out of the queue, and no worker said it took it: its taker died
            if position is None and handle.session.in_flight is flight and not flight.worker \
                    and handle.session.request_id in self._handles:
                self._fail_over(handle)
        self._resend_unanswered([h for h, flight in current if h.session.in_flight is flight
                                 and alive.get(flight.worker)], looked_at)

    def _resend_unanswered(self, handles: list[SessionHandle], now: float) -> None:
        """Blocks at a live verify worker unanswered for RESEND_AFTER_S (and each time as long again) and out of its
        queue: sent to it once more, and said in the log, so that what lost the first copy can be found."""
        due = [h for h in handles
               if now - h.session.in_flight.sent_at > RESEND_AFTER_S * (h.session.in_flight.unanswered_periods + 1)]
        if not due:
            return
        self.outbox.flush()  # its copies go after what was handed over before
        with self.client.pipeline(transaction=False) as pipe:
            for handle in due:
                flight = handle.session.in_flight
                pipe.lpos(protocol.verify_worker_queue(flight.worker), flight.payload)
            positions = self._execute(pipe, TRIP_RESEND)
        for handle, position in zip(due, positions):
            if position is not None:  # still queued: its worker has not come to it yet; look again later
                handle.session.in_flight.unanswered_periods += 1
        due = [handle for handle, position in zip(due, positions) if position is None]
        if not due:
            return
        with self.client.pipeline(transaction=False) as pipe:
            for handle in due:
                flight = handle.session.in_flight
                flight.unanswered_periods += 1
                flight.measured = False  # its round trip holds the wait: not the link's
                logger.warning("request %s: verify worker %s has not answered round %d in %.1fs while heartbeating, "
                               "and it is out of its queue; sending the block again", handle.session.request_id,
                               flight.worker, flight.block.round, now - flight.sent_at,
                               extra={"request_id": handle.session.request_id})
                pipe.rpush(protocol.verify_worker_queue(flight.worker), flight.payload)
            self._execute(pipe, TRIP_RESEND)
        self.meter.resent_blocks += len(due)

    def _fail_over(self, handle: SessionHandle) -> None:
        session = handle.session
        flight = session.in_flight
        logger.warning("request %s: verify worker %s is gone; resending round %d to pool %s",
                       session.request_id, flight.worker or "that took it from the pool", session.round,
                       session.spec.pool, extra={"request_id": session.request_id})
        session.sticky_worker = None
        flight.worker = None
        flight.sent_at = time.perf_counter()  # its deadlines count from the resend
        session.drop_ahead()
        self.meter.count_round_trip(TRIP_FAILOVER)
        self.outbox.flush()
        self.client.rpush(protocol.verify_pool_queue(session.spec.pool), flight.payload)
        self.meter.failed_over_blocks += 1

    def _cancel(self, handle: SessionHandle) -> None:
        """Close the stream with a 'cancelled' event and free the verify side's KV cache."""
        self._close_stream(handle.session, "cancelled")
        handle.session.finish_reason = "cancelled"
        self._finish(handle)

    def _fail(self, handle: SessionHandle, error: str) -> None:
        """End the session with an error event in its stream (the gateway answers with it at once, instead of
        waiting for its request's timeout) and free the verify side's KV cache."""
        try:
            self._close_stream(handle.session, "error", error)
        except Exception:  # Redis away: the gateway's own checks end the request
            logger.exception("request %s: could not write its error event", handle.session.request_id,
                             extra={"request_id": handle.session.request_id})
        self._finish(handle, error=error)

    def _close_stream(self, session: DraftSession, reason: str, error: str | None = None) -> None:
        """A finished event (`reason`) at the end of the stream, unless it has one; then the release block."""
        stream = protocol.output_stream(session.request_id)
        self.outbox.flush()  # its blocks handed over go first: the release block must come after them
        for _ in range(8):  # a verify worker may commit a round in between: retry at the new length
            with self.client.pipeline(transaction=False) as pipe:
                pipe.xlen(stream)
                pipe.xrevrange(stream, count=1)
                seq, last = self._execute(pipe, TRIP_CLOSE)
            if last and OutputEvent.decode(last[0][1][b"m"]).finished:
                break
            self.meter.count_round_trip(TRIP_CLOSE)
            event = OutputEvent(request_id=session.request_id, seq=int(seq), token_ids=[],
                                num_output_tokens=session.num_output, finished=True, finish_reason=reason,
                                error=error, stats=session.stats)
            if self.committer.commit(stream_key=stream, verdict_key=session.reply_to, expected_seq=int(seq),
                                     event=event.encode(), verdict=b"") == -1:
                break
        worker = session.sticky_worker
        queue = protocol.verify_worker_queue(worker) if worker else protocol.verify_pool_queue(session.spec.pool)
        self.meter.count_round_trip(TRIP_CLOSE)
        self.client.rpush(queue, session.release_block().encode())

    def _finish(self, handle: SessionHandle, error: str | None = None) -> None:
        session = handle.session
        self._handles.pop(session.request_id, None)
        self._due.pop(session.request_id, None)
        session.in_flight = None
        session.ahead = []
        session.release()
        handle.error = error
        handle.summary = session.summary()
        logger.info("request %s: session ended after %d rounds (%s)", session.request_id, session.round,
                    error or session.finish_reason, extra={"request_id": session.request_id})
        handle.done.set()

    def drive(self, session: DraftSession, on_tick: Callable[[], None] | None = None,
              every_s: float = 2.0, on_started: Callable[[], None] | None = None) -> SessionSummary:
        """From a task thread: run `session` to its end, calling on_started() once the driver has it and
        on_tick() every every_s (the lease's renewal); raises SessionFailed when it cannot finish."""
        handle = self.submit(session)
        if on_started is not None:
            on_started()
        while not handle.done.wait(every_s):
            if on_tick is not None:
                try:
                    on_tick()
                except Exception:  # a missed lease renewal is retried next tick
                    logger.exception("request %s: tick failed", session.request_id,
                                     extra={"request_id": session.request_id})
        if handle.error is not None:
            raise SessionFailed(handle.error)
        return handle.summary
