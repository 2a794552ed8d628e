"""Which draft a round takes: the one that promises more tokens per millisecond.

A round that drafts g tokens yields 1 + (expected accepted) tokens and costs the draft's time plus one target
forward over g + 1 tokens. A suffix draft costs no draft time and knows how sure it is (the frequencies of its
continuation); a model draft costs `draft_ms` a token and is right with its measured per-token acceptance
alpha. Costs are in units of a one-token target forward, so only their ratios matter:

    suffix:  (1 + score) / verify(g_suffix + 1)
    model:   (1 + alpha + ... + alpha^g) / (g * draft + verify(g + 1))

verify(k) = 1 + growth * (k - 1): a forward over k tokens, relative to one token (on an accelerator, and on a
CPU for a small target, growth is small; a measured curve gives it per session).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.speculative.bound import expected_accepted


@dataclass(frozen=True)
class DraftPrices:
    """What drafting costs, relative to a one-token target forward."""

    model_draft: float = 0.3  # one model draft token
    verify_growth: float = 0.05  # each extra token of a verified block

    def verify(self, num_tokens: int) -> float:
        return 1.0 + self.verify_growth * max(0, num_tokens - 1)


def suffix_rate(score: float, num_draft_tokens: int, prices: DraftPrices) -> float:
    """Expected tokens per unit of cost of a suffix draft with this score (expected accepted tokens)."""
    return (1.0 + score) / prices.verify(num_draft_tokens + 1)


def model_rate(alpha: float, num_draft_tokens: int, prices: DraftPrices) -> float:
    """Expected tokens per unit of cost of a model draft of num_draft_tokens at per-token acceptance alpha."""
    tokens = 1.0 + expected_accepted(alpha, num_draft_tokens)
    return tokens / (num_draft_tokens * prices.model_draft + prices.verify(num_draft_tokens + 1))


def suffix_pays(score: float, num_suffix_tokens: int, *, model_alpha: float, model_tokens: int,
                prices: DraftPrices) -> bool:
    """Whether the suffix draft beats the model draft this round (a tie goes to the suffix: it costs no core)."""
    if num_suffix_tokens <= 0:
        return False
    if model_tokens <= 0:
        return True
    return suffix_rate(score, num_suffix_tokens, prices) >= model_rate(model_alpha, model_tokens, prices)
