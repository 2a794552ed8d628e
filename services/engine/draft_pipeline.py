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

from services.models.drafters.base import DraftProposal, Drafter, block_probs, per_token_probs
from services.models.drafters.batched import DraftCall, propose_many
from services.protocol import Verdict
from services.speculative.params import SamplingParams

logger = logging.getLogger(__name__)

POLL_EVERY_S = 0.002  # how often speculation asks Redis whether the verdict is in


@dataclass
class Speculation:
    bonus_guess: int
    draft_ids: list[int]  # block k+1
    draft_probs: torch.Tensor | None  # [len(draft_ids), vocab] or None (point mass)
    elapsed_s: float
    finished_at: float  # wall clock (time.time) when drafting it ended
    drafter: str = ""  # who drafted block k+1's first token (DraftProposal.drafter)


class SpeculationState:
    """One session's speculation in progress: the bonus guess, then block k+1, a call at a time.

    A stepwise drafter (a model draft) drafts one token per call, so a batch of sessions advances together
    and stops between any two tokens when a verdict arrives; any other drafter drafts the guess, then the
    block, in two calls, exactly as that round would draft it."""

    def __init__(self, drafter: Drafter, context: Sequence[int], next_length: int, sampling: SamplingParams,
                 generator: torch.Generator | None, guess_generator: torch.Generator | None = None) -> None:
        self.drafter = drafter
        self.context = list(context)  # committed + block k, assumed accepted whole
        self.next_length = next_length
        self.sampling = sampling
        self.generator = generator  # round k+1's own stream
        self.guess_generator = guess_generator or generator
        self.stepwise = bool(getattr(drafter, "stepwise", False))
        self.tokens: list[int] = []
        self.probs: list[torch.Tensor | None] = []  # per token; None: a point mass
        self.drafters: list[str] = []  # per token: DraftProposal.drafter
        self.elapsed_s = 0.0
        self.stalled = False  # the drafter had nothing more to propose
        self.drafted_at = 0.0  # wall clock (time.time) when its last token was drafted

    @property
    def done(self) -> bool:
        return self.stalled or len(self.tokens) >= self.next_length + 1

    def next_call(self) -> DraftCall:
        if not self.tokens:  # the guess of the bonus token, from its own stream
            return DraftCall(self.drafter, self.context, 1, self.sampling, self.guess_generator)
        count = 1 if self.stepwise else self.next_length + 1 - len(self.tokens)
        return DraftCall(self.drafter, [*self.context, *self.tokens], count, self.sampling, self.generator)

    def add(self, proposal: DraftProposal, elapsed_s: float) -> None:
        self.elapsed_s += elapsed_s
        self.drafted_at = time.time()
        if not proposal.token_ids:
            self.stalled = True
            return
        self.tokens.extend(proposal.token_ids)
        self.probs.extend(per_token_probs(proposal))
        self.drafters.extend([proposal.drafter] * proposal.num_draft_tokens)

    def result(self) -> Speculation | None:
        """The speculation as drafted so far; None when not even the guess was drafted."""
        if not self.tokens:
            return None
        return Speculation(self.tokens[0], self.tokens[1:], block_probs(self.probs[1:], self.tokens[1:]),
                           self.elapsed_s, self.drafted_at,  # when drafting ended, not when it is read
                           self.drafters[1] if len(self.drafters) > 1 else "")


WARM_UP_TOKENS = 64  # draft prefill per driver turn: a cold session's prompt never holds verdicts up for long


def cold_by_engine(items: Sequence[tuple[Drafter, Sequence[int]]]) -> tuple[list[int], list]:
    """Of (drafter, context) pairs: the indexes of those whose KV holds their context (or that need none), and
    the others as (draft engine, [(KV-holding drafter, context), ...]) groups, one per engine."""
    warm, cold = [], {}
    for index, (drafter, context) in enumerate(items):
        holder = getattr(drafter, "model", drafter)  # a hybrid's model half holds the KV
        engine = getattr(holder, "draft_engine", None)
        if engine is None or holder.missing(context) == 0:
            warm.append(index)
        else:
            cold.setdefault(id(engine), (engine, []))[1].append((holder, context))
    return warm, list(cold.values())


def warm_up(states: list[SpeculationState], budget: int = WARM_UP_TOKENS) -> list[SpeculationState]:
    """The states ready to speculate: those whose model draft already holds their context (or that need no
    KV). Cold ones (a new session's prompt) get up to `budget` of their missing tokens prefilled this turn,
    batched per draft engine, and speculate once warm: a burst of new sessions prefills a piece per turn
    between verdicts instead of all at once inside one speculation step."""
    warm, cold = cold_by_engine([(state.drafter, state.context) for state in states])
    for engine, items in cold:
        engine.prefill_many(items, budget)
    return [states[index] for index in warm]


def prefill(items: Sequence[tuple[Drafter, Sequence[int]]]) -> None:
    """All that the drafters' KV lacks of their contexts, batched per draft engine, a chunk per forward."""
    left = None
    while True:
        _, cold = cold_by_engine(items)
        missing = sum(holder.missing(context) for _, group in cold for holder, context in group)
        if not missing or (left is not None and missing >= left):  # done, or no forward gets further
            return
        left = missing
        for engine, group in cold:
            engine.prefill_many(group, missing)


def speculate_many(states: list[SpeculationState], verdict_ready: Callable[[], bool] = lambda: False) -> list[float]:
    """Advance every state, one batched draft call per step (services/models/drafters/batched.py), until all
    are done or verdict_ready() says a verdict waits: speculation holds up the critical path by one step
    at most. Returns the seconds each step took (one batched call: what a block of all of them waits a token)."""
    active = [state for state in states if not state.done]
    steps = []
    while active and not verdict_ready():
        started = time.perf_counter()
        proposals = propose_many([state.next_call() for state in active])
        steps.append(time.perf_counter() - started)
        share = steps[-1] / len(active)
        for state, proposal in zip(active, proposals):
            state.add(proposal, share)
        active = [state for state in active if not state.done]
    return steps


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
    """One session's speculation: the bonus guess plus up to next_length tokens after committed +
    draft_ids, stopping as soon as the verdict is ready (asked at most every poll_every_s). None: nothing
    usable was drafted.

    Sampling: the guess draws from guess_generator, the block from `generator` (the next round's own
    stream), so a speculated block is the very block that round would draft: output never depends on
    when the verdict arrived."""
    if next_length <= 0 or not draft_ids:
        return None
    state = SpeculationState(drafter, [*committed, *draft_ids], next_length, sampling, generator, guess_generator)
    speculate_many([state], throttled(verdict_ready, poll_every_s))
    return state.result()


def throttled(ready: Callable[[], bool], every_s: float) -> Callable[[], bool]:
    """ready(), asked at most every every_s (a Redis round trip per draft token would cost more than it saves)."""
    last = [time.perf_counter()]

    def check() -> bool:
        now = time.perf_counter()
        if now - last[0] < every_s:
            return False
        last[0] = now
        return ready()

    return check


def speculation_holds(speculation: Speculation, num_sent: int, verdict: Verdict) -> bool:
    """Block k was accepted whole, nothing after it was committed, and the target's bonus token is the one the
    speculation assumed."""
    return (
        not verdict.finished
        and verdict.num_accepted == num_sent
        and len(verdict.committed_ids) == num_sent + 1
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
    chained_rounds: int = 0  # rounds whose block was verified ahead of its parent's verdict reaching the draft
    chains_broken: int = 0  # verdicts that dropped the blocks sent after theirs
    caught_up_rounds: int = 0  # rounds bridged while the draft prefilled, taken from the stream before drafting

    def as_fields(self) -> dict[str, float]:
        return {
            "draft_s": self.draft_s,
            "speculation_s": self.speculation_s,
            "hidden_s": self.hidden_s,
            "speculations": float(self.speculations),
            "speculation_hits": float(self.speculation_hits),
            "chained_rounds": float(self.chained_rounds),
            "chains_broken": float(self.chains_broken),
            "caught_up_rounds": float(self.caught_up_rounds),
        }
