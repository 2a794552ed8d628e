"""What a verify worker writes to requests' output streams: rounds (with their verdicts), errors,
cancellations, and the events a Redis failover lost, written again.

Every write goes through the commit-a-round script (services/redis_client.py): an event is appended only when
the stream holds exactly the events before it, so a second verifier of a round (a worker thought dead that
was only slow) cannot commit twice, and an event committed again lands once.
"""

from __future__ import annotations

import logging
import time

import redis
from redis.exceptions import NoScriptError

from services import protocol
from services.history_feed import HISTORY_PROMPT_TAIL, append_finished
from services.protocol import DraftBlock, FinishedOutput, OutputEvent
from services.redis_client import RoundCommitter, SentCommands
from verify_worker.committed import CommittedEvents
from verify_worker.records import Recorder
from verify_worker.session_table import SessionTable
from verify_worker.sessions import VerifySession
from verify_worker.verdicts import CommitItem, failure_item

logger = logging.getLogger(__name__)


class StreamCommits:
    def __init__(self, client: redis.Redis, sessions: SessionTable, worker_id: str,
                 recorder: Recorder | None = None) -> None:
        self.client = client
        self.sessions = sessions
        self.worker_id = worker_id
        self.recorder = recorder  # SQL records of the sessions drafted here (placement local)
        self.committer = RoundCommitter(client)
        self.committed = CommittedEvents()  # to make streams whole after a failover (verify_worker/committed.py)
        self._pending: tuple[list[CommitItem], SentCommands] | None = None  # a batch whose replies are unread

    def fail(self, requests: list[tuple[str, DraftBlock | None]], reason: str) -> None:
        """End these requests with an error event (and a verdict to their senders); drop their sessions."""
        self.settle()
        with self.client.pipeline(transaction=False) as pipe:
            for request_id, _ in requests:
                pipe.xlen(protocol.output_stream(request_id))
            lengths = pipe.execute()
        message = f"verify worker {self.worker_id}: {reason}"
        self.publish([failure_item(request_id, block, int(seq), message, self.worker_id)
                       for (request_id, block), seq in zip(requests, lengths)])
        for request_id, _ in requests:
            session = self.sessions.pop(request_id)
            if session is not None and session.local is not None and self.recorder is not None:
                self.recorder.ended(session.local, len(session.target.output.output_ids), error=message)

    def publish(self, items: list[CommitItem], *, defer: bool = False) -> None:
        """Every item's event and verdict in one batch of commits, written now; their replies are read here, or,
        with defer, by the next settle() (the caller's next forward overlaps the round trip: Redis applies the
        commits when it reads them, only this worker's bookkeeping of the replies waits)."""
        self.settle()
        if not items:
            return
        for item in items:  # first: whatever happens to the batch, a failover's refill has them
            if item.event:
                self.committed.record(item.request_id, item.seq, item.event)
        self._pending = (items, SentCommands(self.client, [self._command(item) for item in items]))
        if not defer:
            self.settle()

    def settle(self) -> None:
        """Read the replies of the batch written last and act on them: a session whose commit lost (the stream
        moved: a cancellation, another verifier) is dropped, one whose stream is shorter than what this worker
        committed (a Redis failover lost events) is made whole again, a finished one is let go."""
        if self._pending is None:
            return
        (items, sent), self._pending = self._pending, None
        replies = sent.replies()
        unloaded = [index for index, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if unloaded:  # Redis lost its scripts (a restart): none of those ran; load and commit them again
            self.committer.load()
            again = SentCommands(self.client, [self._command(items[index]) for index in unloaded]).replies()
            for index, reply in zip(unloaded, again):
                replies[index] = reply
        self._apply(items, replies)

    def abandon(self) -> None:
        """Forget the batch in flight (Redis went away: the refill after it commits again what it lacks)."""
        if self._pending is not None:
            self._pending[1].abandon()
            self._pending = None

    def _command(self, item: CommitItem) -> tuple:
        return self.committer.command(stream_key=protocol.output_stream(item.request_id),
                                      verdict_key=item.reply_to, expected_seq=item.seq, event=item.event,
                                      verdict=item.verdict)

    def _apply(self, items: list[CommitItem], replies: list[object]) -> None:
        short = []
        for item, reply in zip(items, replies):
            if isinstance(reply, Exception):
                logger.error("request %s: commit failed: %s", item.request_id, reply,
                             extra={"request_id": item.request_id})
                self.sessions.pop(item.request_id)
                self.committed.forget(item.request_id)
            elif item.event and 0 <= int(reply) < item.seq:
                short.append(item)
            elif item.event and int(reply) != -1:
                logger.info("request %s round %d: the stream holds %d events (cancelled, or another verifier "
                            "committed): session dropped", item.request_id, item.seq, int(reply),
                            extra={"request_id": item.request_id})
                self.sessions.pop(item.request_id)
                self.committed.forget(item.request_id)
            elif item.finished:
                self._finished(item)
        if short:
            self.refill([item.request_id for item in short], verdicts=short)
            for item in short:
                if item.finished:
                    self._finished(item)

    def _finished(self, item: CommitItem) -> None:
        logger.info("request %s finished here at round %d", item.request_id, item.seq,
                    extra={"request_id": item.request_id})
        self.committed.finish(item.request_id, time.monotonic())
        session = self.sessions.pop(item.request_id, retire=True)
        if session is not None:
            self._remember(session)
        if session is not None and session.local is not None and self.recorder is not None:
            self.recorder.ended(session.local, len(session.target.output.output_ids))

    def _remember(self, session: VerifySession) -> None:
        """The finished output into the fleet's history for suffix drafts (services/history_feed.py)."""
        output_ids = session.target.output.output_ids
        if not output_ids:
            return
        spec = session.spec
        output = FinishedOutput(request_id=spec.request_id, tenant=spec.tenant,
                                prompt_tail=list(spec.prompt_ids[-HISTORY_PROMPT_TAIL:]), output_ids=list(output_ids))
        try:
            append_finished(self.client, output)
        except redis.RedisError as exc:  # a draft not made later, nothing lost now
            logger.warning("request %s: its output did not reach the suffix history (%s)", spec.request_id, exc)

    def refill(self, request_ids: list[str], verdicts: list[CommitItem] = ()) -> int:
        """Append again the events these requests' streams lost (verify_worker/committed.py), then push
        `verdicts` (of commits that found their stream short). A stream that lost more than is kept ends
        with an error. Returns the events appended again."""
        self.settle()
        with self.client.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.xlen(protocol.output_stream(request_id))
            lengths = pipe.execute()
        appended, lost = 0, []
        with self.client.pipeline(transaction=False) as pipe:
            for request_id, have in zip(request_ids, lengths):
                missing = self.committed.missing(request_id, int(have))
                if missing is None:
                    lost.append(request_id)
                    continue
                if missing:
                    logger.warning("request %s: its stream lost rounds %d..%d (a Redis failover?): committed "
                                   "them again", request_id, missing[0][0], missing[-1][0],
                                   extra={"request_id": request_id})
                for seq, event in missing:
                    self.committer.commit(stream_key=protocol.output_stream(request_id), verdict_key="",
                                          expected_seq=seq, event=event, verdict=b"", client=pipe)
                appended += len(missing)
            for item in verdicts:
                if item.verdict and item.request_id not in lost:
                    self.committer.commit(stream_key="", verdict_key=item.reply_to, expected_seq=0, event=b"",
                                          verdict=item.verdict, client=pipe)
            pipe.execute()
        if lost:
            self.fail([(request_id, None) for request_id in lost],
                       "the queue (Redis) lost more of this request's output than can be committed again")
            for request_id in lost:
                self.committed.forget(request_id)
        return appended

    def end_cancelled(self, session: VerifySession) -> None:
        """A 'cancelled' event closes a local session's stream (unless a round of another verifier just did)."""
        self.settle()
        target = session.target
        event = OutputEvent(request_id=session.request_id, seq=session.round, token_ids=[],
                            num_output_tokens=len(target.output.output_ids), finished=True,
                            finish_reason="cancelled", stats=target.stats, worker_id=self.worker_id)
        self.committer.commit(stream_key=protocol.output_stream(session.request_id), verdict_key="",
                              expected_seq=session.round, event=event.encode(), verdict=b"")
        session.local.finish_reason = "cancelled"
        if self.recorder is not None:
            self.recorder.ended(session.local, len(target.output.output_ids))
