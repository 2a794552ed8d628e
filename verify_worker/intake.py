"""A verify worker's intake: each queued block placed with the sessions held here (verify_worker/decisions.py
`place` says what it is), a session built from the request's committed prefix in Redis when none here is in the
block's state (a new request, an evicted or failed-over one), a session drafted here (placement local) started, a
stale block answered with a resync verdict from the stream.

A chained block (sent ahead of its parent's verdict, services/speculative/chaining.py) waits parked behind its
parent; right after the parent's verdict the worker goes on with it when the parent was accepted whole with the
bonus the block assumed, or drops it (the sender does the same on that verdict).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import redis

from services import protocol
from services.models.engine import TargetEngine
from services.protocol import BlockTaken, DraftBlock, OutputEvent, ProtocolError, SessionSpec
from services.redis_client import REQUEST_TTL_S
from services.speculative.bridging import bridges
from services.speculative.chaining import chain_holds, followed
from verify_worker.commits import StreamCommits
from verify_worker.decisions import Placement, place
from verify_worker.draft_word import DraftWord
from verify_worker.figures import WorkerFigures
from verify_worker.local_drafts import LocalDrafting
from verify_worker.records import Recorder
from verify_worker.session_table import SessionTable
from verify_worker.sessions import VerifySession, build_session, resume_block
from verify_worker.verdicts import CommitItem, block_verdict

logger = logging.getLogger(__name__)


class Intake:
    def __init__(self, *, client: redis.Redis, engine: TargetEngine, sessions: SessionTable, commits: StreamCommits,
                 figures: WorkerFigures, draft_word: DraftWord, worker_id: str, instance: str, bridge: bool,
                 local: LocalDrafting | None, recorder: Recorder | None, draft_after_opening: bool,
                 held_speculative: Callable[[], int], word: Callable[[], str], said: Callable[[str], None],
                 settle: Callable[[], None]) -> None:
        self.client = client
        self.engine = engine
        self.sessions = sessions
        self.commits = commits
        self.figures = figures
        self.draft_word = draft_word
        self.worker_id = worker_id
        self.instance = instance
        self.bridge = bridge  # scheduler.bridge
        self.local = local
        self.recorder = recorder
        self.draft_after_opening = draft_after_opening
        self.held_speculative = held_speculative  # remote speculative sessions held, for the draft's word (or 0)
        self.word = word  # the load word a verdict answered here now carries
        self.said = said  # the word on a verdict just sent
        self.settle = settle  # the replies of the last step's commits
        self.num_blocks = 0

    def place_blocks(self, arrived: list[tuple[DraftBlock, bool]]) -> None:
        """Blocks popped from the queues, each with whether it came from the pool's queue."""
        blocks, taken = [], []
        for block, pooled in arrived:
            if place(block, self.sessions.get(block.request_id))[0] is Placement.SECOND_START:
                continue
            blocks.append(block)
            if pooled and not block.release and block.reply_to:
                taken.append(block)
        if taken:  # tell each sender whose heartbeat to watch until the verdict comes
            with self.client.pipeline(transaction=False) as pipe:
                for block in taken:
                    pipe.rpush(block.reply_to, BlockTaken(block.request_id, block.round, self.worker_id).encode())
                pipe.execute()
        rebuild, chained = [], []
        held = self.held_speculative()
        for block in blocks:
            self.num_blocks += 1
            session = self.sessions.get(block.request_id)
            # the plain route's rounds are no word on the load, nor target-only rounds this worker's word asked for
            if session is not None and session.spec.route == "sd" and not session.told_plain:
                self.draft_word.heard(block, held)
            placement, num_bridged = place(block, session)
            if placement is Placement.RELEASE:
                self.sessions.pop(block.request_id, retire=True)
            elif placement is Placement.CHAINED:  # placed once the blocks before it are (its parent may start it)
                chained.append(block)
            elif placement is Placement.REBUILD:
                rebuild.append(block)
            elif placement is Placement.DUPLICATE:
                logger.debug("request %s round %d: a duplicate of the block in hand", block.request_id, block.round,
                             extra={"request_id": block.request_id})
            elif placement is Placement.BRIDGED:
                session.note_arrival()
                self._take_bridged(session, block, num_bridged)
            elif placement is Placement.TAKE:
                session.note_arrival()
                self._take(session, block)
        if rebuild:
            self._rebuild(rebuild)
        for block in chained:
            self._place_chained(block)

    def _take(self, session: VerifySession, block: DraftBlock) -> None:
        try:
            session.take(block)
        except (ProtocolError, AssertionError) as exc:  # its draft probs do not match its tokens
            self.commits.fail([(block.request_id, block)], f"bad block: {exc}")
            return
        self.sessions.touch(session)

    def _take_bridged(self, session: VerifySession, block: DraftBlock, num_bridged: int) -> None:
        """A block drafted `num_bridged` bridged rounds ago (services/speculative/bridging.py): the rest of it
        is verified from here, or, when nothing is left of it, it is answered at once and the bridge goes on."""
        if num_bridged == 0:
            self._take(session, block)
            return
        try:
            going = session.take_bridged(block, num_bridged)
        except (ProtocolError, AssertionError) as exc:
            self.commits.fail([(block.request_id, block)], f"bad block: {exc}")
            return
        self.sessions.touch(session)
        self.figures.record_bridged(num_bridged, answered=not going)
        if not going:
            verdict = block_verdict(session, self.worker_id, self.word())
            self.said(verdict.load_arm)
            self.commits.publish([CommitItem.verdict_only(block, verdict)])
            session.answered(verdict, behind_bridge=True)

    def _take_next(self, session: VerifySession, block: DraftBlock) -> None:
        """A block that goes on from the session's last verdict (a chained block renumbered by followed())."""
        num_bridged = session.bridged_since(block) if session.bridging else 0
        if num_bridged is None:
            self._rebuild([block])
        else:
            self._take_bridged(session, block, num_bridged)

    def _place_chained(self, block: DraftBlock) -> None:
        """A block sent ahead of its parent's verdict (services/speculative/chaining.py): parked while its
        parent is in hand, taken when its parent is done here and the assumption held, dropped when it did not
        (its sender drops it too, on the same verdict). A parent this worker never had (a failover, an
        eviction): checked against the stream like any block."""
        session = self.sessions.get(block.request_id)
        if session is not None and session.expects(block):
            session.parked.append(block)
        elif session is not None and session.last_block is not None \
                and session.last_block.block_id == block.parent_id:
            if session.block is None and not session.target.finished \
                    and chain_holds(session.last_verdict, session.last_block, block):
                session.note_arrival()
                self._take_next(session, followed(block, session.last_verdict))
            else:
                logger.debug("request %s round %d: chained block dropped (its parent's verdict broke the chain)",
                             block.request_id, block.round, extra={"request_id": block.request_id})
        else:
            self._rebuild([block])

    def continue_chains(self, sessions: list[VerifySession]) -> None:
        """Sessions whose block just got its verdict go on with their parked chained block, if it holds: no
        trip to the draft worker and back between the two."""
        for session in sessions:
            if session.block is None and session.parked and session.request_id in self.sessions:
                child = session.next_in_chain()
                if child is not None:
                    self._take_next(session, followed(child, session.last_verdict))

    def _rebuild(self, blocks: list[DraftBlock]) -> None:
        """Blocks whose session is not here in the right state: read spec and stream (one round trip) and
        build the session, resume a half-done block, or answer with a resync verdict."""
        self.settle()  # the streams as this worker's own commits left them
        with self.client.pipeline(transaction=False) as pipe:
            for block in blocks:
                pipe.get(protocol.request_key(block.request_id))
                pipe.xrange(protocol.output_stream(block.request_id))
            replies = pipe.execute()
        resyncs: list[CommitItem] = []
        owned: list[str] = []
        for index, block in enumerate(blocks):
            raw_spec, entries = replies[2 * index], replies[2 * index + 1]
            try:
                if block.draft_here:
                    self._start_local(block, raw_spec, entries, owned)
                else:
                    self._rebuild_one(block, raw_spec, entries, resyncs)
            except Exception as exc:  # the process boundary for one request
                logger.exception("request %s: could not rebuild its session", block.request_id,
                                 extra={"request_id": block.request_id})
                self.commits.fail([(block.request_id, None if block.draft_here else block)],
                                  f"{type(exc).__name__}: {exc}")
        if owned:  # the gateway's recovery watches this worker's heartbeat for them
            with self.client.pipeline(transaction=False) as pipe:
                for request_id in owned:
                    pipe.set(protocol.owner_key(request_id), self.instance, ex=REQUEST_TTL_S)
                pipe.execute()
        if resyncs:
            self.commits.publish(resyncs)

    def _start_local(self, block: DraftBlock, raw_spec: bytes | None, entries: list, owned: list[str]) -> None:
        """A session this worker drafts for itself: built from its committed output, with its draft half."""
        if self.local is None:
            raise ValueError(f"verify worker {self.worker_id} does not draft (its placement is remote): a start "
                             "block reached a pool whose workers wait for draft workers")
        if raw_spec is None:
            logger.warning("request %s has no spec (expired?): start dropped", block.request_id,
                           extra={"request_id": block.request_id})
            return
        events = [OutputEvent.decode(fields[b"m"]) for _, fields in entries]
        if events and events[-1].finished:
            return
        session = build_session(self.engine, SessionSpec.decode(raw_spec), events, reuse=self.sessions.reuse_prefix)
        self.local.attach(session, events, drafting=sum(1 for held in self.sessions if held.local is not None))
        self.sessions.put(session)
        owned.append(session.request_id)
        if self.recorder is not None:
            self.recorder.started(session.request_id)

    def _rebuild_one(self, block: DraftBlock, raw_spec: bytes | None, entries: list, resyncs: list) -> None:
        if raw_spec is None:
            logger.warning("request %s has no spec (expired?): dropping its block", block.request_id,
                           extra={"request_id": block.request_id})
            self.sessions.pop(block.request_id)
            return
        events = [OutputEvent.decode(fields[b"m"]) for _, fields in entries]
        spec = SessionSpec.decode(raw_spec)
        outcome = resume_block(self.engine, spec, events, block, reuse=self.sessions.reuse_prefix)
        if isinstance(outcome, VerifySession):
            outcome.may_bridge = bridges(spec.sampling, spec.route, enabled=self.bridge)
            outcome.draft_after_opening = self.draft_after_opening
            self.sessions.put(outcome)  # replaces (and frees) whatever this worker held for the request
        elif outcome is not None:  # a stale block: answered, and a session held here is left as it is
            resyncs.append(CommitItem.verdict_only(block, outcome))
