"""The verify loop: take draft blocks (own queue first, then the pool's), run batched target steps, commit.
(Over 300 lines: local drafting and the step share the session table and one turn's invariants; what goes to the
streams is in commits.py, the placement of blocks in intake.py, the decisions in decisions.py.)

Each turn of the loop:
1. intake: pop what is queued (blocking only when there is nothing to do);
   a block joins its session, or the session is built from the request's
   committed prefix in Redis (a new request, an evicted or failed-over one);
2. batch window: while sessions that just got a verdict have not sent their
   next block yet, wait for them up to `scheduler.timeout_ms`, so they share
   the step (no wait when no block is on its way: one stream never slows);
3. step: the planner picks rows under `max_batch_size` and the token budget,
   one forward runs them all, the round math is applied per session;
4. commit: every session's output event (and verdict, when its block is
   done) in one batch, each through the atomic commit script, written now
   and its replies read after the next forward (commits.py settle);
   blocks queued during the step are popped before the verdicts are made
   (the openings among them are load the verdicts tell: told_load.py) and
   taken after they went out.

A block covers one drafted round and, optionally, target-only rounds the
worker then runs on its own (plain decoding needs no round trip per token).
A block for rounds that are already committed (a draft task redelivered,
a resend after a failover) is answered with a resync verdict from the
stream, so its sender moves on instead of waiting.

What a queued block is to the sessions held here, and the sessions built or answered for it, is the intake's
(verify_worker/intake.py); the loop's decisions (rows ready, how long to block, token budget, threads) are
functions of the sessions held (verify_worker/decisions.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import msgpack
import redis
import torch

from services.history_feed import history_figures
from services import protocol
from services.config import MergingSettings, SchedulerSettings
from services.engine.target import RoundResult, StepSplit, run_step
from services.engine.wide_steps import WIDE_MIN_TOKENS
from services.link.meter import smoothed
from services.models.engine import TargetEngine
from services.probes import apply_override, read_device
from services.protocol import DraftBlock, ProtocolError
from services.redis_client import write_heartbeat
from verify_worker.commits import StreamCommits
from verify_worker.draft_word import DraftWord
from verify_worker import decisions
from verify_worker.figures import WorkerFigures
from verify_worker.intake import Intake
from verify_worker.load_word import LoadWord, remote_arm
from verify_worker.local_drafts import LocalDrafting
from verify_worker.records import Recorder
from verify_worker.scheduler import Candidate, plan_step
from verify_worker.session_table import SessionTable
from verify_worker.sessions import VerifySession
from verify_worker.told_load import new_sessions, openings_waiting, told_rows
from verify_worker.verdicts import CommitItem, block_verdict, round_item

logger = logging.getLogger(__name__)

CANCEL_CHECK_S = 0.5  # how often sessions running target-only rounds on their own look for a cancellation
IDLE_SESSION_S = 600.0  # a session with no block for this long is dropped (its draft side is gone)
COMMITTED_EXPIRE_S = 5.0  # how often the record of committed events forgets requests no longer held


class VerifyWorker:
    def __init__(
        self,
        *,
        client: redis.Redis,
        engine: TargetEngine,
        worker_id: str,
        pool: str,
        scheduler: SchedulerSettings | None = None,
        merging: MergingSettings | None = None,
        device: str = "cpu",
        device_kind: str | None = None,
        profile: dict | None = None,
        local: LocalDrafting | None = None,
        recorder: Recorder | None = None,
        wide_threads: int | None = None,
        plain_wide_min_tokens: int = WIDE_MIN_TOKENS,
        draft_after_opening: bool = False,
        load_word: bool = True,
    ) -> None:
        self.client = client
        self.engine = engine
        self.target = engine.target
        self.device = device
        self.device_kind = device_kind  # reported instead of the probed kind (worker.device_kind)
        self.profile = profile or {}
        self.scheduler = scheduler or SchedulerSettings()
        self.worker_id = worker_id
        self.instance = protocol.instance_id(worker_id, os.getpid())  # what owner keys name
        self.pool = pool
        self.local = local  # placement local: it drafts for its own sessions
        self.recorder = recorder  # SQL records of those sessions
        # torch threads per step: `threads` while a draft worker drafts for any session here (on one box it has a
        # core of its own), wide_threads while none does (that core is idle then; settings.worker.wide_threads)
        self.threads = torch.get_num_threads()
        self.wide_threads = wide_threads if local is None else None  # co-located drafting has every core already
        self.wide_min_tokens = WIDE_MIN_TOKENS  # the fewest tokens of a wide step
        # ... while no session's draft may be drafting (VerifySession.drafts_now): timed here at start (services/
        # engine/wide_steps.py); beside such a session a small wide step lost more than it gained
        self.plain_wide_min_tokens = plain_wide_min_tokens
        # speculative.draft_prefill "after_opening": remote drafts prefill a session after its opening round
        draft_after_opening = draft_after_opening and local is None
        self.draft_word = DraftWord()  # the remote draft's last word on the load (verify_worker/draft_word.py)
        # its word to remote drafts on its load (verify_worker/load_word.py); None: settings.worker.load_word off
        self.load_word = LoadWord() if load_word and local is None else None
        self.last_word = ""  # the word on the last verdict sent: a new session's draft most likely heard it last
        self._committed: int | None = 0  # tokens the last step committed; None: it prefilled a prompt too
        self._forward_s: float | None = None  # the last step's forward
        self._step_s: float | None = None  # smoothed step time: no bridged round starts with a block due in one
        self.sessions = SessionTable(engine, merging)
        self.commits = StreamCommits(client, self.sessions, worker_id, recorder)  # verify_worker/commits.py
        self._outage = False
        self._carried: list[tuple[DraftBlock, bool]] = []  # blocks popped by a step that failed after: next intake
        self._expired_at = 0.0
        self.queues = [protocol.verify_worker_queue(worker_id), protocol.verify_pool_queue(pool)]
        self.figures = WorkerFigures()
        self.intake = Intake(  # verify_worker/intake.py
            client=client, engine=engine, sessions=self.sessions, commits=self.commits, figures=self.figures,
            draft_word=self.draft_word, worker_id=worker_id, instance=self.instance, bridge=self.scheduler.bridge,
            local=local, recorder=recorder, draft_after_opening=draft_after_opening,
            held_speculative=lambda: self._speculative_sessions() if self.wide_threads is not None else 0,
            word=lambda: self._word(self._load()), said=self._said, settle=self._settle)
        self.num_bad_messages = 0
        self._cancel_checked = 0.0  # the first session that needs it is checked at once
        # Written by the loop after each step, read by the heartbeat thread: a long step must not delay
        # heartbeats past their TTL.
        self._snapshot = (0, 0, {}, {})  # (num_sessions, kv_cache_bytes, prefix figures, measured arms by load)

    # --- the loop -------------------------------------------------------------------------------
    def serve(self, stop: threading.Event, poll_s: float = 0.5) -> None:
        logger.info("verify worker %s serving pool %s (queues %s)", self.worker_id, self.pool, self.queues)
        while not stop.is_set():
            try:
                if self._outage:  # back: a failover's new primary may lack what was committed last
                    self.commits.refill(self.commits.committed.tracked())
                    self._outage = False
                self.turn(poll_s)
            except redis.RedisError as exc:  # Redis gone for a moment: keep the sessions, try again
                logger.warning("verify worker %s: Redis error (%s); retrying", self.worker_id, exc)
                self.commits.abandon()
                self._outage = True
                stop.wait(0.5)
            except Exception:  # the process boundary: one bad turn must not end the worker
                logger.exception("verify worker %s: unexpected error in a turn", self.worker_id)
                stop.wait(0.1)
        try:  # the last step's commit replies: its finished requests recorded and remembered before the exit
            self._settle()
        except redis.RedisError as exc:
            logger.warning("verify worker %s: the last commits' replies were not read (%s)", self.worker_id, exc)

    def turn(self, poll_s: float = 0.5) -> int:
        """One intake, local drafting, batch window and step; returns the rows stepped (0: idle). Its stages are
        timed into self.figures.stages (verify_worker/figures.py StageTimes)."""
        stages = self.figures.stages
        turn_started = time.perf_counter()
        if not self._ready():  # no forward to overlap the last step's commits: their replies now
            self._settle()
        raws = self._pop(decisions.pop_timeout(carried=bool(self._carried), ready_now=bool(self._ready()),
                                               local_now=bool(self._local_due()), poll_s=poll_s,
                                               bridge_s=self._bridge_wait()))
        carried, self._carried = self._carried, []
        self._admit_blocks(carried + self._decode(raws))
        started = time.perf_counter()
        self._draft_local()
        stages.since("draft", started)
        self._wait_for_expected_blocks()
        self._check_cancellations()
        self.sessions.drop_idle(IDLE_SESSION_S)
        if time.monotonic() - self._expired_at > COMMITTED_EXPIRE_S:
            self._expired_at = time.monotonic()
            self.commits.committed.expire(self._expired_at, live={session.request_id for session in self.sessions})
        self._committed, self._forward_s = 0, None
        rows = self.step() if self._ready() else 0
        if self.local is not None:  # what this turn's drafting (or not) gave, for the next turns' choice
            self.local.settle(self._committed, time.perf_counter() - started, self._forward_s)
        arms = self.local.turns if self.local is not None else self.load_word
        self._snapshot = (len(self.sessions), self.sessions.kv_bytes, self.sessions.prefix_figures(),
                          arms.to_dict() if arms is not None else {})
        stages.turns += 1
        stages.since("turn", turn_started)
        return rows

    @property
    def num_blocks(self) -> int:
        return self.intake.num_blocks

    @property
    def draft_after_opening(self) -> bool:
        """speculative.draft_prefill "after_opening": remote drafts prefill a session after its opening round (the
        intake marks the sessions it builds)."""
        return self.intake.draft_after_opening

    @draft_after_opening.setter
    def draft_after_opening(self, value: bool) -> None:
        self.intake.draft_after_opening = value

    def _said(self, word: str) -> None:
        self.last_word = word

    def _settle(self) -> None:
        """The replies of the last step's commits (verify_worker/commits.py settle)."""
        started = time.perf_counter()
        self.commits.settle()
        self.figures.stages.since("settle", started)

    def _ready(self) -> list[VerifySession]:
        return decisions.ready(self.sessions, self._step_s)

    def _bridge_wait(self) -> float:
        return decisions.bridge_wait(self.sessions, self._step_s)

    def _local(self) -> list[VerifySession]:
        return [session for session in self.sessions if session.local is not None]

    def _local_due(self) -> list[VerifySession]:
        return decisions.local_due(self.sessions)

    def _draft_local(self) -> None:
        due = self._local_due()
        if not due:
            return
        try:
            self.local.draft(due, load=len([session for session in self.sessions if session.active]))
        except Exception as exc:  # the process boundary of these requests: they end with the error
            logger.exception("drafting %d local sessions failed", len(due))
            self.commits.fail([(session.request_id, None) for session in due],
                              f"drafting failed: {type(exc).__name__}: {exc}")

    def _expected(self) -> int:
        return decisions.expected(self.sessions, time.monotonic())

    def _wait_for_expected_blocks(self) -> None:
        window_s = self.scheduler.timeout_ms / 1000
        deadline = time.monotonic() + window_s
        while window_s > 0 and self._expected() and len(self._ready()) < self.scheduler.max_batch_size:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._admit(self._pop(left))

    # --- intake ---------------------------------------------------------------------------------
    def _pop(self, timeout_s: float, min_room: int = 1) -> list[tuple[bytes, bool]]:
        """Queued blocks, own queue first, each with whether it came from the pool's queue; waits up to
        timeout_s for the first when nothing is queued. The pool's new sessions only as far as this worker has
        room (at least min_room)."""
        started = time.perf_counter()
        room = max(min_room, self.scheduler.max_batch_size - len(self._ready()))
        with self.client.pipeline(transaction=False) as pipe:
            pipe.lpop(self.queues[0], self.scheduler.max_batch_size)
            if room:
                pipe.lpop(self.queues[1], room)
            replies = pipe.execute()
        own, pooled = replies[0], replies[1] if room else None
        raws = [(raw, False) for raw in own or []] + [(raw, True) for raw in pooled or []]
        waiting = self.figures.stages.since("intake", started)
        if raws or timeout_s <= 0:
            return raws
        item = self.client.blpop(self.queues, timeout=max(timeout_s, 0.001))
        self.figures.stages.since("wait", waiting)
        return [(item[1], item[0].decode() == self.queues[1])] if item else []

    def _decode(self, raws: list[tuple[bytes, bool]]) -> list[tuple[DraftBlock, bool]]:
        """Popped messages as blocks, each with whether it came from the pool; a bad one is counted and dropped."""
        started = time.perf_counter()
        decoded = []
        for raw, pooled in raws:
            try:
                decoded.append((DraftBlock.decode(raw), pooled))
            except ProtocolError as exc:
                self.num_bad_messages += 1
                logger.warning("dropped a bad message: %s", exc)
        self.figures.stages.since("intake", started)
        return decoded

    def _admit(self, raws: list[tuple[bytes, bool]]) -> None:
        self._admit_blocks(self._decode(raws))

    def _admit_blocks(self, arrived: list[tuple[DraftBlock, bool]]) -> None:
        started = time.perf_counter()
        self.intake.place_blocks(arrived)
        self.figures.stages.since("intake", started)


    # --- one step -------------------------------------------------------------------------------
    def step(self) -> int:
        stages = self.figures.stages
        planning = time.perf_counter()
        ready = {session.request_id: session for session in self._ready()}
        planned = plan_step(
            (Candidate(key, session.spec.priority, session.target.num_pending_tokens,
                       session.target.streaming, session.arrived_at)
             for key, session in ready.items()),
            max_rows=self.scheduler.max_batch_size, max_tokens=self._step_tokens())
        chosen = self._fit_kv_budget([(ready[row.key], row.token_budget) for row in planned])
        if not chosen:
            return 0
        started = time.perf_counter()
        sessions = [session for session, _ in chosen]
        num_tokens = sum(s.target.num_pending_tokens if budget is None else min(budget, s.target.num_pending_tokens)
                         for s, budget in chosen)
        streaming = [s.target.streaming for s in sessions]  # running streams, not prompts being prefilled
        load, busy = self._load(), self._busy_drafts()  # the load this step runs at, whose drafts are busy
        wide = self._set_threads(num_tokens, busy)
        stages.since("plan", planning)
        split = StepSplit()
        try:
            forward_started = time.perf_counter()
            results = run_step(self.engine, [s.target for s in sessions], [budget for _, budget in chosen], split)
            forward_s = self._forward_s = time.perf_counter() - forward_started
        except Exception as exc:  # the process boundary: fail the step's requests, keep serving
            logger.exception("a step over %d rows failed", len(sessions),
                             extra={"request_ids": [s.request_id for s in sessions]})
            self.commits.fail([(s.request_id, s.block) for s in sessions], f"{type(exc).__name__}: {exc}")
            return 0
        stages.prepare_s += split.prepare_s
        stages.forward_s += split.forward_s
        stages.apply_s += split.apply_s
        outage = None
        try:  # the last step's commits, written before this forward: their replies
            self._settle()
        except redis.RedisError as exc:  # this step's rounds are applied: their commits are recorded first
            outage = exc
        remote = any(s.drafted_remotely for s in sessions)
        arriving = self._arrivals() if remote and outage is None else []
        try:
            building = time.perf_counter()
            rows, told_load = self._told_load(sessions, load, [block for block, _ in arriving]) if remote \
                else (len(sessions), load)
            items = self._outcomes(sessions, results, rows=rows, word=self._word(told_load))
            committing = stages.since("events", building)
            self.commits.publish(items, defer=True)  # the replies are read after the next forward
            stages.since("commit", committing)
            if outage is not None:
                raise outage
            self.intake.continue_chains(sessions)
        except BaseException:
            self._carried = arriving  # taken at the next turn's intake (after an outage: once Redis is back)
            raise
        self._admit_blocks(arriving)
        step_s = time.perf_counter() - started
        if all(streaming):  # a bridged round is one streaming token: prefill chunks say nothing of its cost
            self._step_s = smoothed(self._step_s, step_s, weight=0.2)
        # what the turn measures for co-located drafting: tokens committed, unless a prompt was being
        # prefilled in it (that cost falls on drafting and plain turns alike, at random)
        self._committed = sum(len(result.committed) for result in results if result is not None) \
            if all(streaming) else None
        if self.load_word is not None:
            self.load_word.stepped(load, remote_arm(busy), self._committed, time.monotonic(),
                                   starting=all(not session.opened for session in self._drafted_remotely()))
        self.figures.record_step(rows=len(sessions), tokens=num_tokens, forward_s=forward_s, step_s=step_s,
                                 streaming_rows=sum(streaming), wide=wide,
                                 streamed=sum(len(result.committed) for result, running in zip(results, streaming)
                                              if result is not None and running))
        self.sessions.evict_idle()
        return len(sessions)

    def _arrivals(self) -> list[tuple[DraftBlock, bool]]:
        """Blocks queued during a step, taken once its verdicts are out: the openings among them are load the
        verdicts tell (verify_worker/told_load.py). The pool's only as far as this worker has room after the step
        (none when full: another worker may take them). Redis away: none (they wait in their queues), and the
        step's commits meet the outage as before, its sessions' rounds applied."""
        try:
            return self._decode(self._pop(0.0, min_room=0))
        except redis.RedisError:
            return []

    def _told_load(self, sessions: list[VerifySession], load: int, arriving: list[DraftBlock]) -> tuple[int, int]:
        """The rows and the load (for the word) the verdicts of a step with a remote speculative session tell: with
        the openings on their way (a step without one, co-located drafting or the plain route, tells its own)."""
        queued = new_sessions(arriving, (session.request_id for session in self.sessions))
        waiting = openings_waiting(self.sessions, {session.request_id for session in sessions})
        return told_rows(len(sessions), waiting, queued, self.scheduler.max_batch_size), load + queued

    def _step_tokens(self) -> int:
        return decisions.step_tokens(self.sessions, self.scheduler)

    def _set_threads(self, num_tokens: int, busy: list[bool] | None = None) -> bool:
        """The step's torch threads (verify_worker/decisions.py ThreadChoice): wide while no draft worker drafts
        for any session held here, else `threads`. True: this step is wide. busy: _busy_drafts(), when the
        caller has it."""
        drafting = any(session.drafts_now and not session.opens_told_plain(self.last_word) for session in self.sessions)
        choice = decisions.ThreadChoice(self.threads, self.wide_threads, self.wide_min_tokens,
                                        self.plain_wide_min_tokens)
        wide = choice.wide_step(num_tokens, drafting=drafting,
                                busy=any(self._busy_drafts() if busy is None else busy))
        wanted = choice.threads_for(wide)
        if torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
        return wide

    def _drafted_remotely(self) -> list[VerifySession]:
        return [s for s in self.sessions if s.drafted_remotely]

    def _speculative_sessions(self) -> int:
        return len(self._drafted_remotely())

    def _word(self, load: int) -> str:
        """What this step's verdicts tell remote drafts about the load ("" without a word)."""
        return self.load_word.word(load) if self.load_word is not None else ""

    def _load(self) -> int:
        """The sessions held that have not finished: the load this worker's word is about."""
        return sum(1 for session in self.sessions if not session.target.finished)

    def _busy_drafts(self) -> list[bool]:
        """Per remote speculative session held, whether its draft worker drafts for it now or is about to."""
        remote = self._drafted_remotely()
        return decisions.busy_drafts(remote, waits_idle=self.draft_word.goes_plain(len(remote)),
                                     last_word=self.last_word)

    def _draft_busy(self) -> bool:
        """A draft worker drafts for a session held here, or is about to."""
        return any(self._busy_drafts())

    def _fit_kv_budget(self, planned: list[tuple[VerifySession, int | None]]) -> list[tuple[VerifySession, int | None]]:
        """Drop rows whose KV growth does not fit the budget even after evicting idle sessions (they wait);
        a request that cannot fit alone in the whole budget fails with an error."""
        store = self.engine.store
        chosen: list[tuple[VerifySession, int | None]] = []
        growth = 0
        keep = {session.request_id for session, _ in planned}
        for session, budget in planned:
            row_tokens = session.target.num_pending_tokens if budget is None else min(
                budget, session.target.num_pending_tokens)
            needed = store.growth_bytes(session.target.sequence, session.target.num_cached + row_tokens)
            if needed == 0 or self.sessions.evict_idle(growth + needed, keep=keep):
                chosen.append((session, budget))
                growth += needed
            elif not chosen:
                if store.budget_bytes is not None and \
                        session.target.sequence.reserved_bytes + needed > store.budget_bytes:
                    self.commits.fail([(session.request_id, session.block)],
                               f"the request needs {needed} bytes of KV cache, more than this worker's whole "
                               f"budget of {store.budget_bytes} (worker.kv_budget_mb)")
                    continue
                chosen.append((session, budget))  # over budget for one step: sessions in flight finish
                growth += needed
        return chosen

    def _outcomes(self, sessions: list[VerifySession], results: list[RoundResult | None],
                  rows: int, word: str = "") -> list[CommitItem]:
        items = []
        drafting = len(self._local())  # local sessions, for their controllers' view of the draft load
        for session, result in zip(sessions, results):
            if session.request_id not in self.sessions:  # dropped by the last step's commit replies (settled)
                continue
            self.sessions.touch(session)
            if result is None:  # a prefill chunk: nothing to commit yet
                continue
            if session.block is None:  # a bridged round: its tokens stream, the next block's verdict says them
                items.append(round_item(session, result, self.worker_id))
                continue
            if not session.first_round_done:
                session.first_round_done = True
                session.batch_rows = rows
                verification = result.verification
                self.figures.record_round(verification.num_draft_tokens, verification.num_accepted)
            verdict = block_verdict(session, self.worker_id, "" if session.local else word) \
                if session.block_done() else None
            if verdict is not None and session.local is None:
                self.last_word = word
            items.append(round_item(session, result, self.worker_id, None if session.local else verdict))
            if verdict is not None:
                if session.local is not None:  # drafted here: the verdict stays in this process
                    self.local.on_verdict(session, verdict, drafting=drafting)
                session.answered(verdict)
        return items

    def _check_cancellations(self) -> None:
        """Sessions running target-only rounds on their own, and those drafted here, have no draft worker
        asking each round; a local one's stream is ended here, as its draft worker would."""
        if time.monotonic() - self._cancel_checked < CANCEL_CHECK_S:
            return
        running = [session for session in self.sessions if session.autonomous or session.local is not None]
        if not running:
            return  # the clock starts with the first such session: a request cancelled early stops at once
        self._cancel_checked = time.monotonic()
        with self.client.pipeline(transaction=False) as pipe:
            for session in running:
                pipe.exists(protocol.cancel_key(session.request_id))
            cancelled = pipe.execute()
        for session, flag in zip(running, cancelled):
            if flag:
                logger.info("request %s cancelled: its rounds stop", session.request_id,
                            extra={"request_id": session.request_id})
                if session.local is not None:
                    self.commits.end_cancelled(session)
                self.sessions.pop(session.request_id, retire=True)

    # --- heartbeat ------------------------------------------------------------------------------
    def heartbeat(self, ttl_s: float) -> None:
        num_sessions, kv_bytes, prefix_figures, arms = self._snapshot
        raw_override = self.client.get(protocol.probe_override_key(self.worker_id))
        reading = apply_override(read_device(self.device, report_as=self.device_kind),
                                 msgpack.unpackb(raw_override) if raw_override else None)
        beat = protocol.Heartbeat(
            worker_id=self.worker_id,
            role="verify",
            pool=self.pool,
            model=self.target.name,
            num_sessions=num_sessions,
            kv_cache_bytes=kv_bytes,
            queue_depth=int(self.client.llen(self.queues[1])),
            device_kind=reading.device_kind,
            utilization=reading.utilization,
            memory_used_frac=reading.memory_used_frac,
            temperature_c=reading.temperature_c,
            overridden=list(reading.overridden),
            profile=self.profile,
            prefix_cache=prefix_figures,
            pid=os.getpid(),
            host=socket.gethostname(),
            local_draft=self.local.spec if self.local is not None else "",
            local_turns=arms,
            draft_fallback=self.local.fallback if self.local is not None else None,
            suffix_history=history_figures(self.local.source) if self.local is not None else {},
            **self.figures.heartbeat_fields(),
        )
        write_heartbeat(self.client, beat, ttl_s)
