"""Which draft a round takes: the one that promises more tokens per millisecond.

A round that drafts g tokens yields 1 + (expected accepted) tokens and costs the draft's time plus one target
forward over g + 1 tokens. A suffix draft costs no draft time and knows how sure it is (the frequencies of its
continuation); a model draft costs `draft_ms` a token and is right with its measured per-token acceptance
alpha. Costs are in units of a one-token target forward, so only their ratios matter:

    suffix:  (1 + score) / verify(g_suffix + 1)
    model:   (1 + alpha + ... + alpha^g) / (g * draft + verify(g + 1))

verify(k): a forward over k tokens relative to one token: the measured curve of the session's cost model where
it has one (linear past its longest measured block), else 1 + growth * (k - 1).

A suffix draft may run longer than the block length the controller chose for the model draft: it costs nothing
to draft, and a long sure match (a rework of an earlier answer, a repeated schema) is where it pays most. Its
length is the one with the most expected tokens per cost along its own chances (best_suffix_length).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.speculative.bound import expected_accepted
from services.speculative.cost_model import CostModel, _interpolate_rows


@dataclass(frozen=True)
class DraftPrices:
    """What drafting costs, relative to a one-token target forward."""

    model_draft: float = 0.3  # one model draft token
    model_prefill: float = 0.04  # one prompt token the model draft must read before it drafts (batched: cheap)
    verify_growth: float = 0.05  # each extra token of a verified block, where no curve is measured
    verify_curve: dict[int, float] = field(default_factory=dict)  # tokens -> cost (1 token: 1.0), measured

    def verify(self, num_tokens: int) -> float:
        if len(self.verify_curve) >= 2:
            return max(1.0, _interpolate_rows(self.verify_curve, num_tokens))
        return 1.0 + self.verify_growth * max(0, num_tokens - 1)

    @classmethod
    def from_cost(cls, cost: CostModel, default: "DraftPrices") -> "DraftPrices":
        """A session's measured prices: its target's one-row curve and its draft's cost per token, each over a
        one-token forward (the default's model_draft where the draft's cost is not measured)."""
        one = cost.verify_cost(1)
        model_draft = cost.draft_ms_per_token / one if cost.draft_ms_per_token > 0 else default.model_draft
        return cls(model_draft=model_draft, model_prefill=model_draft * default.model_prefill / default.model_draft
                   if default.model_draft > 0 else default.model_prefill, verify_growth=default.verify_growth,
                   verify_curve={tokens: ms / one for tokens, ms in cost.verify_ms.items()})


def suffix_rate(score: float, num_draft_tokens: int, prices: DraftPrices) -> float:
    """Expected tokens per unit of cost of a suffix draft with this score (expected accepted tokens)."""
    return (1.0 + score) / prices.verify(num_draft_tokens + 1)


def model_rate(alpha: float, num_draft_tokens: int, prices: DraftPrices, extra_cost: float = 0.0) -> float:
    """Expected tokens per unit of cost of a model draft of num_draft_tokens at per-token acceptance alpha;
    extra_cost: this round's share of a prefill the model draft must do first (prefill_share)."""
    tokens = 1.0 + expected_accepted(alpha, num_draft_tokens)
    return tokens / (num_draft_tokens * prices.model_draft + prices.verify(num_draft_tokens + 1) + extra_cost)


def prefill_share(missing_tokens: int, tokens_left: int, alpha: float, num_draft_tokens: int,
                  prices: DraftPrices) -> float:
    """A round's share of the model draft's prefill of `missing_tokens` (a long prompt it has not read): paid
    once, it serves every round left, about tokens_left / (tokens per round) of them."""
    if missing_tokens <= 0:
        return 0.0
    rounds_left = max(1.0, tokens_left / (1.0 + expected_accepted(alpha, num_draft_tokens)))
    return missing_tokens * prices.model_prefill / rounds_left



def best_suffix_length(cumulative_probs: list[float], prices: DraftPrices) -> int:
    """How many tokens of a suffix draft to send: the prefix with the most expected tokens per cost (its
    chances are nonincreasing, so past some length each token adds less than it costs)."""
    best_length, best_rate, expected = 0, 1.0 / prices.verify(1), 1.0
    for length, chance in enumerate(cumulative_probs, start=1):
        expected += chance
        rate = expected / prices.verify(length + 1)
        if rate > best_rate:
            best_length, best_rate = length, rate
    return best_length


def suffix_pays(score: float, num_suffix_tokens: int, *, model_alpha: float, model_tokens: int,
                prices: DraftPrices, model_extra_cost: float = 0.0) -> bool:
    """Whether the suffix draft beats the model draft this round (a tie goes to the suffix: it costs no core)."""
    if num_suffix_tokens <= 0:
        return False
    if model_tokens <= 0:
        return True
    return suffix_rate(score, num_suffix_tokens, prices) >= model_rate(model_alpha, model_tokens, prices,
                                                                      model_extra_cost)
