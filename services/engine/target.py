"""The speculative round on the target side, written once: prepare -> one forward -> apply.

`TargetSession` is one request on the target: its committed tokens, its KV
sequence in the engine's store, its output rules, its stats and its round
counter. `run_step` runs one round for many sessions at once:

- prepare: each session's row is the tokens the target has not seen yet: the
  uncached committed tokens (a prompt, or a rebuilt session) followed by the
  draft block; under a token budget a long prompt is fed in chunks over
  several steps;
- forward: one engine forward over every row (ragged lengths);
- apply: the pure accept/reject math per session (services/speculative),
  the KV cropped to the accepted tokens, the output advanced.

The in-process engine runs it with one session, the verify worker with many.
Randomness: round r of a seeded request draws from its own stream
("target", r), so a request samples the same tokens in-process, over HTTP,
and after a verify worker rebuilt it elsewhere.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engine.stopping import OutputState
from services.models.engine import TargetEngine
from services.engine.context import check_request_fits
from services.models.decoder import ForwardRow
from services.speculative.grammar_state import GrammarState, mask_logits
from services.speculative.params import SamplingParams
from services.speculative.processing import TokenLogprobs, process_logits, token_logprobs
from services.speculative.stats import FORCED_DRAFTER, SpecDecodingStats
from services.speculative.verification import Verification, verify_block

logger = logging.getLogger(__name__)

MAX_FORCED_TOKENS = 32  # a block of tokens the grammar forces (one round's worth)


@dataclass
class RoundResult:
    verification: Verification
    committed: list[int]  # accepted draft tokens + the recovered or bonus token
    emitted: list[int]  # the part that reached the output (EOS and stops cut the rest)
    logprobs: TokenLogprobs | None = None  # of the committed tokens, when the request asks for them

    def emitted_logprobs(self) -> TokenLogprobs | None:
        return None if self.logprobs is None else self.logprobs.head(len(self.emitted))


class TargetSession:
    """Invariant between rounds: the KV holds every committed token but the last, or fewer (a prompt still
    being prefilled); the next row feeds what it lacks, then the draft block."""

    def __init__(self, engine: TargetEngine, prompt_ids: Sequence[int], *, output: OutputState,
                 sampling: SamplingParams = SamplingParams(), stats: SpecDecodingStats | None = None,
                 round_index: int = 0, forced_drafts: bool = True) -> None:
        target = engine.target
        check_request_fits(target.name, target.max_context, len(prompt_ids))
        self.engine = engine
        self.token_ids: list[int] = [*prompt_ids, *output.output_ids]  # committed: prompt + output so far
        self.num_prompt = len(prompt_ids)  # penalties count the output apart (services/speculative/processing.py)
        self.output = output
        self.sampling = sampling
        self.stats = stats or SpecDecodingStats()
        self.round_index = round_index  # rounds committed so far = the next round's number
        self.forced_drafts = forced_drafts  # a grammar's forced tokens drafted (False: one token a forward)
        self.grammar = None if sampling.grammar is None else GrammarState(
            sampling.grammar, target.tokenizer, target.vocab_size, target.eos_token_ids, output.output_ids)
        self.sequence = engine.new_sequence()
        self._draft_ids: list[int] = []
        self._drafter = ""
        self._forced = (0, 0, 0)  # the block's forced head, its length before the forced tail, the tail
        self._draft_probs: torch.Tensor | None = None

    @property
    def num_committed(self) -> int:
        return len(self.token_ids)

    @property
    def num_cached(self) -> int:
        return self.sequence.length

    @property
    def room(self) -> int:
        """Draft tokens that still fit the context this round."""
        return self.engine.target.max_context - len(self.token_ids)

    @property
    def finished(self) -> bool:
        return self.output.finished

    @property
    def draft_ids(self) -> list[int]:
        return self._draft_ids

    @property
    def num_uncached(self) -> int:
        """Committed tokens the KV lacks: 1 (the last) for a running stream, more while a prompt is prefilled."""
        return len(self.token_ids) - self.sequence.length

    @property
    def streaming(self) -> bool:
        """A running stream: its prompt is in the KV and only the last committed token is not."""
        return self.num_uncached <= 1

    @property
    def num_pending_tokens(self) -> int:
        """Tokens the next rows must feed before the draft block can be verified, block included."""
        return len(self.token_ids) - self.sequence.length + len(self._draft_ids)

    def set_draft(self, draft_ids: Sequence[int], draft_probs: torch.Tensor | None = None,
                  drafter: str = "") -> None:
        """The block this round verifies (empty: a target-only round). draft_probs [n, vocab] or None; drafter:
        who made it (stats count suffix drafts apart). Under a grammar, the tokens it forces open and close the
        block and the drafter's are cut at the first one it forbids (_constrain_draft)."""
        assert len(draft_ids) <= self.room, f"{len(draft_ids)} draft tokens overflow the context"
        self._draft_ids, self._draft_probs, self._drafter = list(draft_ids), draft_probs, drafter
        self._forced = (0, 0, 0)
        if self.grammar is not None:
            self._constrain_draft()

    def _constrain_draft(self) -> None:
        """The block under the grammar: the tokens it forces first (free, whoever drafted), then the drafter's
        tokens where they begin with those, cut at the first token the grammar forbids, then the tokens the
        grammar forces after them."""
        room = min(MAX_FORCED_TOKENS, self.room) if self.forced_drafts else 0
        head = self.grammar.forced()[:room] if room else []
        draft_ids = self._draft_ids
        if head and draft_ids[: len(head)] != head:
            draft_ids, self._draft_probs, self._drafter = head, None, FORCED_DRAFTER
        valid = self.grammar.valid_prefix(draft_ids)
        draft_ids = draft_ids[:valid]
        tail = self.grammar.forced(draft_ids)[: room - len(draft_ids)] if room > len(draft_ids) else []
        if self._draft_probs is not None:
            self._draft_probs = self._draft_probs[:valid]
            if tail:  # the forced tail is a point mass each: one-hot rows beside the drafter's own
                rows = torch.zeros(len(tail), self._draft_probs.shape[-1], dtype=self._draft_probs.dtype)
                rows[torch.arange(len(tail)), torch.tensor(tail)] = 1.0
                self._draft_probs = torch.cat([self._draft_probs, rows])
        self._draft_ids = [*draft_ids, *tail]
        self._forced = (min(len(head), len(draft_ids)), len(draft_ids), len(tail))

    def prepare(self, token_budget: int | None = None) -> ForwardRow:
        """This step's row: the uncached committed tokens and the draft block, or, when that exceeds the
        budget, a prefill chunk that stops before the last committed token (no logits)."""
        uncached = self.token_ids[self.sequence.length :]
        wanted = [*uncached, *self._draft_ids]
        if token_budget is None or len(wanted) <= token_budget or len(uncached) == 1:
            return ForwardRow(self.sequence, wanted, len(self._draft_ids) + 1)
        return ForwardRow(self.sequence, uncached[: max(1, min(token_budget, len(uncached) - 1))], 0)

    def apply(self, target_logits: torch.Tensor) -> RoundResult:
        """The round's verdict from the logits at [last committed, *draft] ([num_draft + 1, vocab])."""
        draft_ids, sampling = self._draft_ids, self.sampling
        generator = None if sampling.greedy else sampling.make_stream("target", self.round_index)
        logits = target_logits
        if sampling.processes_logits:
            logits = process_logits(target_logits, self.token_ids[:self.num_prompt],
                                    self.token_ids[self.num_prompt:], draft_ids, sampling)
        if self.grammar is not None:
            logits = mask_logits(logits, self.grammar.masks(draft_ids))
        verification = verify_block(draft_ids, self._draft_probs, logits, sampling, generator)
        num_accepted = verification.num_accepted
        # The KV holds committed + draft now: keep it through the accepted draft tokens.
        self.sequence.crop(len(self.token_ids) + num_accepted)
        committed = [*draft_ids[:num_accepted], verification.next_token_id]
        logprobs = None if sampling.logprobs is None else token_logprobs(target_logits, committed, sampling.logprobs)
        self.token_ids.extend(committed)
        if self.grammar is not None:
            self.grammar.commit(committed)
        self._draft_ids, self._draft_probs = [], None
        head, before_tail, tail = self._forced
        forced_accepted = min(head, num_accepted) + max(0, min(tail, num_accepted - before_tail))
        self.stats.observe(verification.num_draft_tokens, num_accepted, self._drafter, head + tail, forced_accepted)
        self._forced = (0, 0, 0)
        self.round_index += 1
        return RoundResult(verification, committed, self.output.accept(committed), logprobs)

    def rollback(self, num_committed: int) -> None:
        """Forget everything committed after the first num_committed tokens (the KV follows)."""
        assert 1 <= num_committed <= len(self.token_ids), f"cannot roll back to {num_committed} tokens"
        self.sequence.crop(min(self.sequence.length, num_committed - 1))
        del self.token_ids[num_committed:]
        if self.grammar is not None:
            self.grammar.rollback(self.token_ids[self.num_prompt:])

    def release(self) -> None:
        self.sequence.release()


@dataclass
class StepSplit:
    """Where one step's time went (seconds): building the rows, the engine's forward, the round math per row.
    run_step fills it when given one; the verify worker sums it per stage (verify_worker/figures.py)."""

    prepare_s: float = 0.0
    forward_s: float = 0.0
    apply_s: float = 0.0


def run_step(engine: TargetEngine, sessions: Sequence[TargetSession],
             token_budgets: Sequence[int | None] | None = None,
             split: StepSplit | None = None) -> list[RoundResult | None]:
    """One forward over every session's row; a session whose row was a prefill chunk gets None."""
    budgets = token_budgets or [None] * len(sessions)
    started = time.perf_counter()
    rows = [session.prepare(budget) for session, budget in zip(sessions, budgets)]
    prepared = time.perf_counter()
    logits = engine.forward(rows)
    forwarded = time.perf_counter()
    results = [None if row_logits is None else session.apply(row_logits)
               for session, row_logits in zip(sessions, logits)]
    if split is not None:
        split.prepare_s, split.forward_s = prepared - started, forwarded - prepared
        split.apply_s = time.perf_counter() - forwarded
    return results
