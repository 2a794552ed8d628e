"""Pipelined ("mirror") drafting: draft block k+1 while the verify worker checks block k.

The speculation assumes block k is accepted whole. It drafts one token
more than the next block needs: the first is the drafter's guess of the
target's bonus token, the rest are block k+1. It stops as soon as the
verdict arrives. When the verdict accepts all of block k and its bonus
token equals the guess, the context the speculation was drafted from is
exactly the committed context, so block k+1 goes out at once (topped up
if the speculation was cut short); otherwise it is dropped and redrafted
from the verdict.
Losslessness is untouched: a speculated block is an ordinary draft of the
committed context, verified as usual.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from services.models.drafters.base import Drafter
from services.protocol import Verdict
from services.speculative.sampling import SamplingParams

logger = logging.getLogger(__name__)

POLL_EVERY_S = 0.002  # how often speculation asks Redis whether the verdict is in


@dataclass
class Speculation:
    bonus_guess: int
    draft_ids: list[int]  # block k+1
    draft_probs: torch.Tensor | None  # [len(draft_ids), vocab] or None (point mass)
    elapsed_s: float
    finished_at: float  # wall clock (time.time) when drafting it ended


def speculate(
    drafter: Drafter,
    committed: Sequence[int],
    draft_ids: Sequence[int],
    next_length: int,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    verdict_ready: Callable[[], bool] = lambda: False,
    poll_every_s: float = POLL_EVERY_S,
    guess_generator: torch.Generator | None = None,
) -> Speculation | None:
    """Draft the bonus guess plus up to next_length tokens after committed + draft_ids, one token at a
    time, stopping as soon as the verdict is ready (checked at most every poll_every_s): speculation
    never holds up the critical path by more than one draft step. None: nothing usable was drafted.

    Sampling: the guess draws from guess_generator, the block from `generator` (the next round's own
    stream), so a speculated block is the very block that round would draft: output never depends on
    when the verdict arrived."""
    if next_length <= 0 or not draft_ids:
        return None
    started = time.perf_counter()
    context = [*committed, *draft_ids]
    tokens: list[int] = []
    probs: list[torch.Tensor] = []

    def draft(count: int, stream: torch.Generator | None) -> bool:
        proposal = drafter.propose([*context, *tokens], count, sampling, stream)
        tokens.extend(proposal.token_ids)
        probs.extend(proposal.probs if proposal.probs is not None else [])
        return bool(proposal.token_ids)

    if not getattr(drafter, "stepwise", False):
        # the guess, then the block in one call, exactly as that round would draft it
        if draft(1, guess_generator or generator):
            draft(next_length, generator)
    else:
        last_poll = started
        while len(tokens) < next_length + 1:
            now = time.perf_counter()
            if now - last_poll >= poll_every_s:
                last_poll = now
                if verdict_ready():
                    break
            if not draft(1, generator if tokens else guess_generator or generator):
                break
    if not tokens:
        return None
    draft_probs = torch.stack(probs[1:]) if len(probs) > 1 else None
    return Speculation(tokens[0], tokens[1:], draft_probs, time.perf_counter() - started, time.time())


def speculation_holds(speculation: Speculation, num_sent: int, verdict: Verdict) -> bool:
    """Block k was accepted whole and the target's bonus token is the one the speculation assumed."""
    return (
        not verdict.finished
        and verdict.num_accepted == num_sent
        and bool(verdict.committed_ids)
        and verdict.committed_ids[-1] == speculation.bonus_guess
    )


def hidden_seconds(speculation: Speculation, sent_at: float, verify_finished_at: float) -> float:
    """Drafting time that overlapped the verify round trip: the part of the speculation done
    before the verdict existed (all of it when the speculation finished first)."""
    overlap_end = min(speculation.finished_at, verify_finished_at)
    return max(0.0, min(speculation.elapsed_s, overlap_end - sent_at))


@dataclass
class DraftTiming:
    """Per-session drafting time, summed into Redis for the bench (seconds, counts)."""

    draft_s: float = 0.0  # drafting on the critical path (no speculation to use)
    speculation_s: float = 0.0  # all drafting done while a block was being verified
    hidden_s: float = 0.0  # speculation that was used and overlapped verification
    speculations: int = 0
    speculation_hits: int = 0

    def as_fields(self) -> dict[str, float]:
        return {
            "draft_s": self.draft_s,
            "speculation_s": self.speculation_s,
            "hidden_s": self.hidden_s,
            "speculations": float(self.speculations),
            "speculation_hits": float(self.speculation_hits),
        }
