"""The verify loop's decisions, as functions of the sessions it holds and a few numbers: which sessions have a
row for the next step, how long the loop may block, whether to wait for blocks on their way, the step's token
budget and thread count, what a queued block is to a session held here. No Redis, no clock of their own: the
loop (verify_worker/worker.py) passes `now` and does the I/O; tests call them on sessions built in memory."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from services.config import SchedulerSettings
from services.protocol import DraftBlock
from verify_worker.sessions import VerifySession

EXPECT_NEXT_BLOCK_S = 2.0  # a session that got a verdict this recently is expected to send its next block


def ready(sessions: Iterable[VerifySession], step_s: float | None, now: float | None = None) -> list[VerifySession]:
    """Sessions with a row for the next step: a block in hand, or a bridge whose round is due (step_s: the
    smoothed step time; a bridged round starts only where no block is due within one); when any holds a block,
    every bridge rides along (the step runs anyway)."""
    sessions = list(sessions)
    holding = [session for session in sessions if session.block is not None and session.has_work]
    bridging = [session for session in sessions if session.bridging]
    if holding or not bridging:
        return holding + bridging
    return [session for session in bridging if session.bridge_wait(step_s or 0.0, now) == 0.0]


def bridge_wait(sessions: Iterable[VerifySession], step_s: float | None, now: float | None = None) -> float:
    """Seconds until the first held bridge is due (inf: none)."""
    return min((session.bridge_wait(step_s or 0.0, now) for session in sessions if session.bridging),
               default=float("inf"))


def local_due(sessions: Iterable[VerifySession]) -> list[VerifySession]:
    """Sessions drafted here (placement local) between rounds: their next block is drafted now."""
    return [session for session in sessions
            if session.local is not None and not session.has_work and not session.target.finished]


def expected(sessions: Iterable[VerifySession], now: float) -> int:
    """Sessions whose next block is on its way: answered within EXPECT_NEXT_BLOCK_S, not finished, no block in
    hand (the batch window waits for them so they share the step)."""
    return sum(1 for session in sessions if not session.has_work and not session.target.finished
               and now - session.last_verdict_at < EXPECT_NEXT_BLOCK_S)


def pop_timeout(*, carried: bool, ready_now: bool, local_now: bool, poll_s: float, bridge_s: float) -> float:
    """How long a turn's intake may block on the queues: not at all while anything can run now (blocks carried
    over from a failed step, rows ready, local sessions to draft), else until the first bridge is due, at most
    poll_s (the loop's stop check)."""
    if carried or ready_now or local_now:
        return 0.0
    return min(poll_s, bridge_s)


def step_tokens(sessions: Iterable[VerifySession], scheduler: SchedulerSettings) -> int:
    """The step's token budget: max_batch_tokens while a stream runs here (a longer step would hold up its next
    token), the larger prefill_only_batch_tokens while every session held is still prefilling."""
    if any(session.target.streaming and not session.target.finished for session in sessions):
        return scheduler.max_batch_tokens
    return max(scheduler.max_batch_tokens, scheduler.prefill_only_batch_tokens)


@dataclass(frozen=True)
class ThreadChoice:
    """A worker's torch threads per step: `threads` while a draft worker may draft beside it (on one box it has a
    core of its own), `wide` (None: never) for a step of at least `wide_min_tokens` tokens while none does, or
    `plain_wide_min_tokens` while no session held may be drafting at all (the plain route, target-only rounds)."""

    threads: int
    wide: int | None
    wide_min_tokens: int
    plain_wide_min_tokens: int

    def wide_step(self, num_tokens: int, *, drafting: bool, busy: bool) -> bool:
        """Whether a step of num_tokens runs wide: drafting, some session's draft may be drafting; busy, some
        draft worker drafts for a session held here now (a wide step would share its core: torch's threads wait
        on each other, one sharing a busy core slows the whole step several-fold)."""
        fewest = self.wide_min_tokens if drafting else min(self.wide_min_tokens, self.plain_wide_min_tokens)
        return self.wide is not None and self.wide != self.threads and num_tokens >= fewest and not busy

    def threads_for(self, wide: bool) -> int:
        return self.wide if wide and self.wide is not None else self.threads


def busy_drafts(remote: Sequence[VerifySession], *, waits_idle: bool, last_word: str) -> list[bool]:
    """Per remote speculative session, whether its draft worker drafts for it now or is about to: a session waiting
    on a draft call is taken as idle when the draft's last word at this load said target-only rounds (waits_idle),
    and an opening told "plain" (last_word) as idle too."""
    return [session.keeps_a_draft_busy and not (session.awaits_draft_call and waits_idle)
            and not session.opens_told_plain(last_word) for session in remote]


class Placement(enum.Enum):
    """What a queued block is to the sessions held here (verify_worker/intake.py acts on it)."""

    SECOND_START = "second start"  # a start of a session held here (a gateway revived one that was only slow)
    RELEASE = "release"  # the sender is done: free the session
    CHAINED = "chained"  # sent ahead of its parent's verdict: placed after the others
    REBUILD = "rebuild"  # no session here, or not in the block's state: read spec and stream
    DUPLICATE = "duplicate"  # the block in hand, again
    BRIDGED = "bridged"  # drafted during the bridge's rounds: verify what is left of it
    TAKE = "take"  # the session's next block


def place(block: DraftBlock, session: VerifySession | None) -> tuple[Placement, int | None]:
    """What `block` is to `session` (the one held here for its request, or None), and for BRIDGED the bridged
    rounds since it was drafted."""
    if block.draft_here and session is not None:
        return Placement.SECOND_START, None
    if block.release:
        return Placement.RELEASE, None
    if block.parent_id:
        return Placement.CHAINED, None
    if session is None:
        return Placement.REBUILD, None
    if session.block is not None and not session.target.finished and session.block.round == block.round:
        return Placement.DUPLICATE, None
    if session.bridging and (num_bridged := session.bridged_since(block)) is not None:
        return Placement.BRIDGED, num_bridged
    if not session.has_work and session.round == block.round and session.target.num_committed == block.num_committed:
        return Placement.TAKE, None
    return Placement.REBUILD, None  # stale (answered from the stream), or ahead of what this worker holds
