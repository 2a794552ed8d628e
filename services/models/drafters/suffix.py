"""Suffix drafts: no model, no prefill; the continuation of the context's longest earlier match, from the
conversation itself or from the tenant's earlier outputs (drafters/history.py).

`SuffixDrafter` keeps an index over its session's context (prompt and committed output, indexed as they come: a
long prompt costs an index update of microseconds per token, not a forward) and asks the fleet's history for
the same tail; the draft with the higher score (expected accepted tokens) wins. Drafts are point masses, so
rejection sampling stays exact as for prompt lookup.

`SuffixModelDrafter` chooses per round between a suffix draft and a model draft by expected tokens per ms
(services/speculative/draft_choice.py): the suffix draft's score against the model draft's measured acceptance
and cost. Each drafter measures its own acceptance from the context of the next call (what the target kept of
its last proposal), so the choice learns on every path, in-process and on workers alike.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from services.models.drafters.base import DraftProposal, Drafter
from services.models.drafters.history import History
from services.models.drafters.suffix_index import SuffixDraft, SuffixIndex
from services.speculative.cost_model import CostModel
from services.speculative.draft_choice import (
    DraftPrices,
    best_suffix_length,
    prefill_share,
    suffix_pays,
)
from services.speculative.params import SamplingParams
from services.speculative.stats import HISTORY_DRAFTER, SUFFIX_DRAFTER

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SuffixOptions:
    max_depth: int = 32  # longest match looked for
    min_prob: float = 0.1  # a draft stops where the chance all its tokens are right falls below this
    max_spec_factor: float = 1.0  # a draft is at most this many tokens per matched token (plus the offset)
    max_spec_offset: float = 1.0
    min_match: int = 2  # shortest match a draft is made from
    max_draft_tokens: int = 16  # a sure match may be drafted this long, past the block length asked for


@dataclass
class Acceptance:
    """What a drafter's drafts earned, smoothed: per-token acceptance and, for drafts that say how sure they are,
    accepted tokens over expected ones. One per drafter kind per process (DraftSource), shared by every session
    it serves: a new session starts from what the earlier ones measured, not from a guess."""

    alpha: float  # per-token acceptance
    calibration: float = 1.0  # accepted / expected
    weight: float = 0.1
    num_rounds: int = 0

    def update(self, accepted: int, chances: int, expected: float | None) -> None:
        self.num_rounds += 1
        self.alpha += self.weight * (accepted / chances - self.alpha)
        if expected:
            self.calibration += self.weight * (min(2.0, accepted / expected) - self.calibration)


class AcceptanceMeter:
    """A session drafter's acceptance, read from the context of its next call: the tokens of its last proposal
    that the context now carries in place (the target kept them), counted until the first that differs, into
    its `estimate` (its own, or one its process's sessions share)."""

    def __init__(self, prior: float = 0.5, estimate: Acceptance | None = None) -> None:
        self.estimate = estimate if estimate is not None else Acceptance(alpha=prior, weight=0.2)
        self.num_rounds = 0
        self.num_drafted = 0
        self.num_accepted = 0
        self._pending: tuple[int, list[int], float | None] | None = None  # (context length, tokens, expected)

    @property
    def alpha(self) -> float:
        return self.estimate.alpha

    @property
    def calibration(self) -> float:
        return self.estimate.calibration

    def proposed(self, context_length: int, token_ids: list[int], expected: float | None = None) -> None:
        self._pending = (context_length, token_ids, expected) if token_ids else None

    def observe(self, context: Sequence[int]) -> None:
        if self._pending is None:
            return
        start, token_ids, expected = self._pending
        if len(context) <= start:
            return  # not verified yet (a call from the same context)
        accepted = 0
        for token, kept in zip(token_ids, context[start:]):
            if token != kept:
                break
            accepted += 1
        if accepted == len(token_ids) and len(context) - start <= len(token_ids):
            return  # its verdict is not in yet (a speculation on top of the proposal)
        self._pending = None
        self.num_rounds += 1
        self.num_drafted += len(token_ids)
        self.num_accepted += accepted
        # positions after a rejection had no chance
        self.estimate.update(accepted, min(len(token_ids), accepted + 1), expected)


def shared_prefix(seen: list[int], context_ids: Sequence[int]) -> int:
    """How many first tokens the two share. The context usually extends what was seen (one comparison of the
    last 8 seen tokens stands for the rest: a session's committed prefix never changes) or takes a speculated
    tail back; a binary search over whole-slice comparisons finds where."""
    if len(context_ids) >= len(seen) and list(context_ids[max(0, len(seen) - 8):len(seen)]) == seen[-8:]:
        return len(seen)
    low, high = 0, min(len(seen), len(context_ids))  # low: shared; high + 1: not
    while low < high:
        middle = (low + high + 1) // 2
        if list(context_ids[:middle]) == seen[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


class SuffixDrafter:
    """A session's suffix drafter (name "suffix")."""

    stepwise = False
    extends = True  # may propose more than asked: up to options.max_draft_tokens, as long as it pays

    def __init__(self, history: History | None = None, options: SuffixOptions | None = None, *,
                 tenant: str = "", name: str = "suffix", prices: DraftPrices | None = None,
                 learned: Acceptance | None = None) -> None:
        """learned: what this process's suffix drafts earned so far (shared by its sessions)."""
        self.name = name
        self.history = history
        self.tenant = tenant
        self.options = options or SuffixOptions()
        self.prices = prices or DraftPrices()  # a session with a measured cost model binds its own (bind_prices)
        self._index: SuffixIndex | None = None
        self._seen: list[int] = []  # the tokens indexed, in order
        self.meter = AcceptanceMeter(prior=0.5, estimate=learned)
        self.num_local_drafts = 0  # drafts from the session's own context
        self.num_history_drafts = 0  # drafts from the tenant's earlier outputs

    def _sync(self, context_ids: Sequence[int]) -> None:
        """Index the context's new tokens; where it differs from what was indexed (a speculated tail that the
        target rejected), forget back to the common prefix first."""
        seen = self._seen
        common = shared_prefix(seen, context_ids)
        if self._index is None or len(context_ids) + 1 > self._index.capacity:
            self._index = SuffixIndex(max(1024, 2 * len(context_ids)), max_depth=self.options.max_depth)
            common = 0
            self._seen = []
        elif common < len(seen):
            self._index.truncate(common)
            del self._seen[common:]
        new = [int(token) for token in context_ids[common:]]
        self._index.extend(new)
        self._seen.extend(new)

    def speculate(self, context_ids: Sequence[int], num_draft_tokens: int,
                  max_draft_tokens: int | None = None) -> SuffixDraft:
        """The better of the session's own and the tenant history's drafts (higher score), cut where its
        tokens stop paying for their verification; empty when neither matches min_match tokens. Up to
        num_draft_tokens, or with max_draft_tokens (the request's end) up to options.max_draft_tokens."""
        self.meter.observe(context_ids)
        self._sync(context_ids)
        options = self.options
        limit = num_draft_tokens
        if max_draft_tokens is not None:
            limit = max(num_draft_tokens, min(options.max_draft_tokens, max_draft_tokens))
        kwargs = {"min_prob": options.min_prob, "max_spec_factor": options.max_spec_factor,
                  "max_spec_offset": options.max_spec_offset}
        local = replace(self._index.speculate(context_ids, limit, **kwargs), source="conversation")
        fleet = (replace(self.history.speculate(self.tenant, context_ids, limit, **kwargs),
                         source="history") if self.history is not None else SuffixDraft())
        best = fleet if fleet.score > local.score else local
        if best.match_length < options.min_match:
            best = SuffixDraft()
        best = best.cut(best_suffix_length(best.cumulative_probs, self.prices))
        return best

    def propose(self, context_ids: Sequence[int], num_draft_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None, max_draft_tokens: int | None = None) -> DraftProposal:
        if num_draft_tokens <= 0 or not context_ids:
            return DraftProposal([], None)
        draft = self.speculate(context_ids, num_draft_tokens, max_draft_tokens)
        self.note(context_ids, draft)
        return as_proposal(draft)

    def note(self, context_ids: Sequence[int], draft: SuffixDraft) -> None:
        """The draft this round takes is this one (counted, and what the target keeps of it read next call)."""
        if draft.source == "history":
            self.num_history_drafts += 1
        elif draft.token_ids:
            self.num_local_drafts += 1
        self.meter.proposed(len(context_ids), list(draft.token_ids), draft.score)

    def remember(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        """A finished output into the tenant's history, where this process is its own fleet (in-process
        sessions; workers learn every output from the fleet's stream instead: services/history_feed.py)."""
        if self.history is not None:
            self.history.add(self.tenant, prompt_ids, output_ids)

    def release(self) -> None:
        self._index = None
        self._seen = []


class SuffixModelDrafter:
    """Per round, the suffix draft or the model draft, whichever promises more tokens per ms (name
    "suffix:<model>"). Batched drafting (drafters/batched.py) asks `propose_lookup` first, as for the hybrid,
    and steps the model halves of the sessions that chose the model together."""

    extends = True
    needs_prefill = True  # its model half reads the prompt: the session opens with a target-only round

    def __init__(self, lookup: SuffixDrafter, model: Drafter, *, prior_alpha: float = 0.6,
                 name: str = "suffix", learned: Acceptance | None = None) -> None:
        """learned: what this process's model drafts earned so far (shared by its sessions)."""
        self.name = name
        self.lookup = lookup
        self.model = model
        self.model_meter = AcceptanceMeter(prior=prior_alpha, estimate=learned)
        self.num_lookup_rounds = 0
        self.num_model_rounds = 0

    @property
    def prices(self) -> DraftPrices:
        return self.lookup.prices

    def propose(self, context_ids: Sequence[int], num_draft_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None, max_draft_tokens: int | None = None) -> DraftProposal:
        proposal = self.propose_lookup(context_ids, num_draft_tokens, sampling, generator, max_draft_tokens)
        if proposal is not None:
            return proposal
        proposal = self.model.propose(context_ids, num_draft_tokens, sampling, generator)
        self.model_proposed(context_ids, proposal)
        return proposal

    def propose_lookup(self, context_ids: Sequence[int], num_draft_tokens: int, sampling: SamplingParams,
                       generator: torch.Generator | None, max_draft_tokens: int | None = None) -> DraftProposal | None:
        """The suffix draft when it pays this round, else None (the model drafts: propose_many calls
        model_proposed with what it drafted)."""
        if num_draft_tokens <= 0:
            return DraftProposal([], None)
        self.model_meter.observe(context_ids)
        draft = self.lookup.speculate(context_ids, num_draft_tokens, max_draft_tokens)
        # its frequencies are estimates: scaled by what the target kept of its earlier drafts against them
        calibrated = draft.score * min(1.0, self.lookup.meter.calibration)
        alpha = self.model_meter.alpha
        # a long prompt the model draft has not read costs it a prefill first, shared by the rounds left (known
        # from max_draft_tokens: the request's end)
        missing = self.model.missing(context_ids) if hasattr(self.model, "missing") and max_draft_tokens else 0
        prefill = prefill_share(missing, max_draft_tokens or 0, alpha, num_draft_tokens, self.prices)
        if suffix_pays(calibrated, len(draft.token_ids), model_alpha=alpha, model_tokens=num_draft_tokens,
                       prices=self.prices, model_extra_cost=prefill):
            self.num_lookup_rounds += 1
            self.lookup.note(context_ids, draft)
            return as_proposal(draft)
        self.lookup.note(context_ids, SuffixDraft())
        self.num_model_rounds += 1  # whether the model draft pays at all is the block-length controller's call
        return None

    def model_proposed(self, context_ids: Sequence[int], proposal: DraftProposal) -> None:
        self.model_meter.proposed(len(context_ids), list(proposal.token_ids))

    def remember(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self.lookup.remember(prompt_ids, output_ids)

    def release(self) -> None:
        self.lookup.release()
        self.model.release()


def as_proposal(draft: SuffixDraft) -> DraftProposal:
    """A suffix draft as a proposal: point masses, labelled with where it came from."""
    if not draft.token_ids:
        return DraftProposal([], None)
    return DraftProposal(list(draft.token_ids), None,
                         drafter=HISTORY_DRAFTER if draft.source == "history" else SUFFIX_DRAFTER)


def suffix_drafter(drafter: Drafter | None) -> SuffixDrafter | None:
    """The suffix drafter in a drafter (itself, or a per-round choice's suffix half)."""
    lookup = getattr(drafter, "lookup", drafter)
    return lookup if isinstance(lookup, SuffixDrafter) else None


def bind_tenant(drafter: Drafter | None, tenant: str) -> None:
    """A session's suffix drafts read its tenant's history only (SessionSpec.tenant)."""
    suffix = suffix_drafter(drafter)
    if suffix is not None:
        suffix.tenant = tenant


def learned_prior(drafter: Drafter | None, min_rounds: int = 5) -> float | None:
    """The model draft's acceptance its process measured (a per-round choice's model half), for a new session's
    block-length controller to start from; None until min_rounds were measured."""
    if isinstance(drafter, SuffixModelDrafter) and drafter.model_meter.estimate.num_rounds >= min_rounds:
        return drafter.model_meter.estimate.alpha
    return None


def bind_prices(drafter: Drafter | None, cost: CostModel | None, prior: float | None = None) -> None:
    """A session's suffix drafts priced by its measured cost model (the target's curve, the model draft's cost;
    the settings' defaults stay where none is measured), and the model draft's acceptance assumed until it has
    drafted here: `prior`, the session controller's (a worker's recent sessions measured it)."""
    suffix = suffix_drafter(drafter)
    if suffix is not None and cost is not None:
        suffix.prices = DraftPrices.from_cost(cost, suffix.prices)
    if isinstance(drafter, SuffixModelDrafter) and prior is not None and drafter.model_meter.estimate.num_rounds == 0:
        drafter.model_meter.estimate.alpha = prior  # nothing measured in this process yet
