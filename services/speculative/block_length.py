"""Per-session block length (gamma) from recent acceptance, and the fallback to target-only.

Rule (DESIGN.md): over the last `window` drafted rounds, acceptance above
`raise_above` grows gamma by `raise_step` (up to the max), anything else
shrinks it by `lower_step` (down to the min). With a cost model (the
default "cost" policy wherever a profile is known) gamma is instead the
block length with the most expected tokens per ms at the current load,
from the measured step-cost grid; gamma 0 means plain decoding pays more.
The fallback: with a cost model, when after `fallback_min_rounds` drafted
rounds no block length pays for a lone stream (the measured acceptance,
the draft's measured cost and the verify curve say the target alone yields
more tokens per ms), the same rule for every draft; without one, when the
acceptance is below `fallback_below`. Either way the session decodes with
the target alone, and after `probe_after_rounds` such rounds it drafts again
at the minimum gamma with a fresh window (0 disables probing).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import threading
from collections import deque

from services.config import SpeculativeSettings
from services.speculative.cost_model import CostModel, alpha_from_rounds, best_block_length

logger = logging.getLogger(__name__)


def next_block_length(current: int, window_acceptance: float, config: SpeculativeSettings) -> int:
    """The controller's rule as a pure function."""
    if window_acceptance > config.raise_above:
        return min(current + config.raise_step, config.max_draft_tokens)
    return max(current - config.lower_step, config.min_draft_tokens)


def opens_plain(config: SpeculativeSettings, num_prompt_tokens: int, model_draft: bool) -> bool:
    """Whether a request's first round is target-only: with a model draft (it must prefill the prompt before
    it drafts) and a prompt of at least plain_opening_tokens. The draft then prefills while the target does
    (pipelined on a draft worker), so the first token waits for the target's prefill alone. The same rule
    in-process and on draft workers, so seeded requests draw the same rounds everywhere."""
    return model_draft and 0 < config.plain_opening_tokens <= num_prompt_tokens


def within_limits(gamma: int, remaining: int, *caps: int | None) -> int:
    """A block's length: the controller's gamma within the request's limits. A round emits up to gamma + 1
    tokens, so a block never drafts past the request's last token; `caps` (a degraded pool's gamma, the
    KV cache's room; None: no cap) cut it further. The same rule in-process and on draft workers."""
    return max(0, min([gamma, remaining - 1, *(cap for cap in caps if cap is not None)]))


LOAD_PLAIN_ROUNDS = 64  # target-only rounds while the load makes drafting not pay, before looking again

# target-only rounds per block while the verify worker's word is "plain" (verify_worker/load_word.py): it holds
# its word this many steps, so a block that asks for no more hears the next word in time
WORD_PLAIN_ROUNDS = 16


class BlockLengthController:
    """Gamma from recent acceptance; with a cost model (block_policy "cost"), the gamma with the most
    expected tokens per ms for the measured acceptance at the current load (rows per step, from the
    verdicts), where gamma 0 (plain decoding) also competes."""

    def __init__(self, config: SpeculativeSettings, num_draft_tokens: int | None = None,
                 cost: CostModel | None = None, prior: float | None = None, explore: bool = True) -> None:
        """prior: per-token acceptance to assume before this session has drafted (the draft worker's recent
        sessions; default config.prior_acceptance). When it says drafting does not pay even for a lone
        stream, the session starts with target-only rounds, unless `explore` (a share of sessions probes
        anyway, so a prior that went stale can recover)."""
        self.config = config
        self.cost = cost
        self.prior = config.prior_acceptance if prior is None else prior
        start = config.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        self._gamma = max(config.min_draft_tokens, min(start, config.max_draft_tokens))
        self._window: deque[tuple[int, int]] = deque(maxlen=config.window)  # (drafted, accepted)
        self._fallback_rounds_left = 0
        self.num_fallbacks = 0
        # why the last fallback: "acceptance" (no cost model), "cost" (no block length pays for itself), or
        # "link" (one would, but not with the remote draft's link on every round that was not verified ahead)
        self.fallback_reason: str | None = None
        self.rows = 1.0  # rows in the target step this session's blocks share (1 in-process)
        self.draft_sessions: float | None = None  # sessions drafting beside it on its draft worker; None: rows
        # the verify worker's last word on its load (Verdict.load_arm): "plain" overrides the cost model's gamma
        # at that load (its steps measured target-only rounds faster there); the lone-stream fallback still holds
        self.load_word = ""
        if cost is not None and not explore and self._best_for_cost(rows=1.0)[0] == 0:
            self._enter_fallback(self.prior, self._cost_reason())

    @property
    def fallen_back(self) -> bool:
        return self._fallback_rounds_left > 0

    @property
    def num_draft_tokens(self) -> int:
        """Tokens to draft next round; 0 while decoding with the target alone."""
        if self.fallen_back or self.told_plain:
            return 0
        if self.cost is None:
            return self._gamma
        best = self._best_for_cost()[0]  # at the current load: 0 when plain batched decoding yields more
        if best == 0 and self.alone and self._best_for_cost(rows=1.0)[0] == 0:
            # Not worth drafting even for a lone stream, by the acceptance so far: keep probing at the shortest
            # block (cheap when alone; under load a probe would lengthen everyone's step) until the window is
            # long enough for update() to decide on a fallback.
            return self.config.min_draft_tokens
        return best

    @property
    def told_plain(self) -> bool:
        """The verify worker measured target-only rounds faster at its load of the moment."""
        return self.load_word == "plain"

    @property
    def load(self) -> float:
        """The load the next block meets: the target step's rows, and at least the draft worker's sessions
        (while drafting starves the verify worker, its steps run short of rows, and an opening's last prefill
        chunk may run alone: the rows seen would make drafting look cheaper than it is)."""
        return max(self.rows, self.draft_sessions or 1.0)

    @property
    def alone(self) -> bool:
        return self.load <= 1.0

    @property
    def num_plain_rounds(self) -> int:
        """Target-only rounds to run before drafting is looked at again (0 while drafting): the rest of a
        fallback, or a short stretch while the load makes drafting not pay."""
        if self.fallen_back:
            return self._fallback_rounds_left
        if self.told_plain:
            return WORD_PLAIN_ROUNDS
        return LOAD_PLAIN_ROUNDS if self.num_draft_tokens == 0 else 0

    @property
    def window_acceptance(self) -> float:
        drafted = sum(d for d, _ in self._window)
        return sum(a for _, a in self._window) / drafted if drafted else 0.0

    def observe_load(self, rows: float, draft_sessions: float | None = None, word: str = "") -> None:
        """Rows in the step that verified the last block: the load the next block meets; the sessions its
        draft worker drafts (a batched draft step serves them all), when known; the verify worker's word."""
        self.rows = max(1.0, float(rows))
        self.load_word = word
        if draft_sessions is not None:
            self.draft_sessions = max(1.0, float(draft_sessions))

    def _best_for_cost(self, rows: float | None = None) -> tuple[int, float]:
        alpha = alpha_from_rounds(self._window)
        if alpha is None:
            alpha = self.prior
        candidates = range(self.config.min_draft_tokens, self.config.max_draft_tokens + 1)
        if rows is None:
            return best_block_length(alpha, self.cost, candidates, self.load, self.draft_sessions)
        return best_block_length(alpha, self.cost, candidates, rows)  # a what-if at `rows` alike

    def update(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Feed one finished round."""
        if num_draft_tokens == 0:
            # A target-only round (fallback, the load, or a drafter with nothing to say).
            if self._fallback_rounds_left > 0:
                self._fallback_rounds_left -= 1
                if self._fallback_rounds_left == 0:
                    self._window.clear()
                    self._gamma = self.config.min_draft_tokens
            return
        self._window.append((num_draft_tokens, num_accepted))
        acceptance = self.window_acceptance
        enough = len(self._window) >= self.config.fallback_min_rounds
        if self.cost is None:  # no measured costs: acceptance is all there is to go by
            if enough and acceptance < self.config.fallback_below:
                self._enter_fallback(acceptance, "acceptance")
                return
            self._gamma = next_block_length(self._gamma, acceptance, self.config)
        elif enough and self._best_for_cost(rows=1.0)[0] == 0:
            # Pay-off, not acceptance: no block length yields more tokens per ms than the target alone, even
            # for a lone stream, at this acceptance and this draft's measured cost (a well-accepted draft
            # can still cost more than it saves; a free one pays at low acceptance): target alone for a while.
            self._enter_fallback(acceptance, self._cost_reason())

    def after(self, num_draft_tokens: int, num_accepted: int) -> int:
        """num_draft_tokens next round if this round ended so; the controller itself is unchanged."""
        future = copy.copy(self)
        future._window = deque(self._window, maxlen=self._window.maxlen)
        future.update(num_draft_tokens, num_accepted)
        return future.num_draft_tokens

    def _cost_reason(self) -> str:
        """Why the cost model says plain for a lone stream: the link, when without it a block would pay."""
        if self.cost.link_ms <= 0:
            return "cost"
        linkless = dataclasses.replace(self.cost, link_ms=0.0)
        alpha = alpha_from_rounds(self._window)
        candidates = range(self.config.min_draft_tokens, self.config.max_draft_tokens + 1)
        best = best_block_length(self.prior if alpha is None else alpha, linkless, candidates, 1.0)[0]
        return "link" if best else "cost"

    def _enter_fallback(self, acceptance: float, reason: str) -> None:
        self.num_fallbacks += 1
        self.fallback_reason = reason
        probe = self.config.probe_after_rounds
        # With probing disabled the fallback lasts for the rest of the session.
        self._fallback_rounds_left = probe if probe > 0 else 1 << 62
        logger.debug("acceptance %.2f: target-only decoding (%s)", acceptance, reason)


class RecentRounds:
    """What the recent rounds of every session of one draft worker saw: the acceptance its drafter gets
    (the prior a new session starts from, its drafter being the same and its prompts alike, instead of a
    fixed guess) and the load of the verify pool (rows per step, so a new session's first block already
    meets it)."""

    def __init__(self, *, rounds: int = 400, min_rounds: int = 50, explore_every: int = 8) -> None:
        self._rounds: deque[tuple[int, int]] = deque(maxlen=rounds)
        self.min_rounds = min_rounds
        self.explore_every = explore_every
        self.rows = 1.0  # rows per step the last verdict reported
        self.word = ""  # and the verify worker's word on its load (Verdict.load_arm)
        self._sessions = 0
        self._lock = threading.Lock()  # fed by the driver thread, read by task threads building sessions

    def observe(self, num_draft_tokens: int, num_accepted: int, rows: float, word: str = "") -> None:
        with self._lock:
            self.rows = max(1.0, float(rows))
            self.word = word
            if num_draft_tokens:
                self._rounds.append((num_draft_tokens, num_accepted))

    def alpha(self) -> float | None:
        """Maximum-likelihood per-token acceptance over the recent rounds; None until min_rounds are seen."""
        with self._lock:
            rounds = list(self._rounds)
        return alpha_from_rounds(rounds) if len(rounds) >= self.min_rounds else None

    def explore(self) -> bool:
        """True while too few rounds were seen for a prior (with no evidence, a session tries drafting rather
        than trust a fixed guess: config.prior_acceptance would keep a good draft off for every session but
        the explorers), then for every explore_every-th new session: it probes drafting whatever the prior
        says, so a prior that went stale can recover."""
        with self._lock:
            self._sessions += 1
            return len(self._rounds) < self.min_rounds or self._sessions % self.explore_every == 1
