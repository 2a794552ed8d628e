"""What a verify worker writes back: per round an output event, per finished block a verdict.

Built here from the session state, pure (no Redis): the worker commits them
in one pipelined round trip.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from services import protocol
from services.engine.target import RoundResult
from services.protocol import DraftBlock, OutputEvent, Verdict
from verify_worker.sessions import VerifySession


@dataclass
class CommitItem:
    request_id: str
    seq: int  # the stream's length the event expects (its round); ignored without an event
    event: bytes  # encoded OutputEvent, or b"" for a verdict alone
    reply_to: str
    verdict: bytes  # encoded Verdict, or b""
    finished: bool = False

    @classmethod
    def verdict_only(cls, block: DraftBlock, verdict: Verdict) -> "CommitItem":
        return cls(block.request_id, 0, b"", reply_to(block), verdict.encode())


def reply_to(block: DraftBlock) -> str:
    return block.reply_to or protocol.verdict_queue(block.request_id)


def round_item(session: VerifySession, result: RoundResult, worker_id: str,
               verdict: Verdict | None = None) -> CommitItem:
    """The round just applied to `session`: its event, and `verdict` (the block's, when it is done and goes
    back over Redis; a local session's verdict stays in this process)."""
    target = session.target
    output = target.output
    logprobs = result.emitted_logprobs()
    event = OutputEvent(
        request_id=session.request_id,
        seq=session.round - 1,
        token_ids=result.emitted,
        num_output_tokens=len(output.output_ids),
        finished=output.finished,
        finish_reason=output.finish_reason,
        stats=target.stats,
        num_cached_tokens=session.num_cached_tokens,
        worker_id=worker_id,
        **(vars(logprobs) if logprobs is not None else {}),
    )
    target_list = reply_to(session.block) if session.block is not None else protocol.verdict_queue(session.request_id)
    return CommitItem(session.request_id, event.seq, event.encode(), target_list,
                      verdict.encode() if verdict is not None else b"", finished=output.finished)


def block_verdict(session: VerifySession, worker_id: str, load_arm: str = "") -> Verdict:
    block, target = session.block, session.target
    num_draft_tokens, num_accepted = target.stats.minus(session.block_stats)
    return Verdict(
        request_id=session.request_id,
        round=block.round,
        num_committed=target.num_committed,
        num_draft_tokens=num_draft_tokens,
        num_accepted=num_accepted,
        committed_ids=target.token_ids[block.num_committed:],
        finished=target.finished,
        finish_reason=target.output.finish_reason,
        worker_id=worker_id,
        num_rounds=session.round - block.round,
        batch_rows=session.batch_rows,
        stats=target.stats,
        block_sent_at=block.sent_at,
        block_id=block.block_id,
        verify_started_at=session.block_started_at,
        verify_finished_at=time.time(),
        num_bridged=session.num_bridged,
        load_arm=load_arm,
    )


def failure_item(request_id: str, block: DraftBlock | None, seq: int, message: str, worker_id: str) -> CommitItem:
    """End a request with an error event (and tell its sender)."""
    event = OutputEvent(request_id=request_id, seq=seq, token_ids=[], num_output_tokens=0, finished=True,
                        finish_reason="error", error=message)
    verdict = b""
    if block is not None:
        verdict = Verdict(request_id=request_id, round=block.round, num_committed=block.num_committed,
                          num_draft_tokens=0, num_accepted=0, committed_ids=[], finished=True,
                          finish_reason="error", worker_id=worker_id).encode()
    target = reply_to(block) if block is not None else protocol.verdict_queue(request_id)
    return CommitItem(request_id, seq, event.encode(), target, verdict, finished=True)
