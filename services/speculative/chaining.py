"""Blocks verified ahead of their verdicts: the rule both sides apply, and how many blocks to keep ahead.

A remote draft keeps up to `depth` blocks at its verify worker. The first is
an ordinary block; each later one is *chained*: drafted on the assumption
that the block before it (its parent) is accepted whole and that the
target's bonus token after it is the draft's guess. The verify worker goes
on with a chained block as soon as its parent's verdict says the assumption
held, without waiting for the draft worker to hear that verdict; when it did
not hold, the chained blocks are dropped on both sides and the draft goes on
from the verdict, as it does without chaining.

A chained block is the very block its round would have been sent after the
verdict (its tokens are drafted from its round's own random stream, and the
context it assumes is checked token for token), so output is unchanged:
greedy output identical to target-only, seeded sampling the same draws.
"""

from __future__ import annotations

import dataclasses
import math

from services.protocol import DraftBlock, Verdict

MAX_BLOCKS_AHEAD = 4  # the auto depth's ceiling: every level deeper is drafted on a longer shot


def chain_holds(verdict: Verdict, parent: DraftBlock, child: DraftBlock) -> bool:
    """The child's assumption, checked against its parent's verdict: the verdict is a real verification of
    that very parent (a one-round block), all of it accepted, the request goes on, and the bonus token is the
    child's guess (so the child's context is exactly what was committed: the parent's tokens and the bonus,
    nothing more). The verdict may cover target-only rounds bridged before the parent came (services/
    speculative/bridging.py): its tokens were checked against them."""
    return (
        child.parent_id != 0
        and child.parent_id == parent.block_id == verdict.block_id
        and bool(verdict.worker_id)
        and parent.num_rounds == 1
        and not verdict.finished
        and verdict.num_accepted == len(parent.draft_ids)
        and len(verdict.committed_ids) == len(parent.draft_ids) + 1
        and verdict.committed_ids[-1] == child.assumed_bonus
        and verdict.num_committed == child.num_committed
    )


def followed(child: DraftBlock, verdict: Verdict) -> DraftBlock:
    """A chained block whose assumption held, numbered as the round after its parent's verdict: it was
    numbered parent + 1 when drafted, and rounds bridged before the parent (services/speculative/bridging.py)
    moved it. Both sides renumber it the same way."""
    after = verdict.round + verdict.num_rounds
    return child if child.round == after else dataclasses.replace(child, round=after)


def blocks_ahead(setting: int, redis_rtt_ms: float | None, verify_ms: float | None,
                 drafting_ms: float | None = None, ceiling: int = MAX_BLOCKS_AHEAD) -> int:
    """How many blocks to keep at the verify worker. setting 1: one at a time (each waits for its
    verdict); N > 1: up to N; 0: from the link: the verify worker should find the next block waiting when
    it finishes one. A block goes out once the verdict of the one `depth` blocks before it is heard, so
    depth - 1 verifications must cover a trip over the link (the draft hears a verdict one way later, its
    next block arrives one way after that) and the drafting of a block (drafting_ms: its tokens and the
    guess of the bonus; behind 100 ms, blocks of 3 came every 60-110 ms against 62 at RTT 0 while the depth
    counted the trip alone). Two at least: the second costs no drafting the speculation did not already do."""
    if setting >= 1:
        return setting
    if not redis_rtt_ms or not verify_ms or verify_ms <= 0:
        return 2
    return max(2, min(ceiling, 1 + math.ceil((redis_rtt_ms + (drafting_ms or 0.0)) / verify_ms)))
