"""Choosing the block length by cost: expected tokens per millisecond from a measured cost curve.

A round with block length g costs g draft steps plus one target forward over
g + 1 tokens, and yields 1 + alpha + ... + alpha^g tokens on average. On a
CPU the forward's cost is not smooth in its length (measured here: 1 token
43 ms, 2 tokens 73 ms, 5 tokens 71 ms), so the best g is read off the
measured curve, not assumed. g = 0 (the target alone) competes too: when
no block length pays for itself, the session should not draft.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from services.speculative.bound import expected_accepted


@dataclass(frozen=True)
class CostModel:
    verify_ms: dict[int, float]  # tokens in one target forward -> ms (measured; at least the 1-token cost)
    draft_ms_per_token: float = 0.0

    def __post_init__(self) -> None:
        if 1 not in self.verify_ms:
            raise ValueError("a cost model needs the 1-token verify cost")
        if any(n < 1 or ms <= 0 for n, ms in self.verify_ms.items()):
            raise ValueError(f"verify costs must be positive, for >= 1 token: {self.verify_ms}")

    @classmethod
    def from_profile(cls, profile: dict, draft_ms_per_token: float | None = None) -> "CostModel | None":
        """From a device profile ({"verify_ms_1": ..., "verify_ms_4": ..., "draft_ms_per_token": ...})."""
        verify = {int(key.rsplit("_", 1)[1]): float(value) for key, value in profile.items()
                  if key.startswith("verify_ms_")}
        if 1 not in verify:
            return None
        draft = draft_ms_per_token if draft_ms_per_token is not None else profile.get("draft_ms_per_token", 0.0)
        return cls(verify, float(draft))

    def verify_cost(self, num_tokens: float) -> float:
        """Measured, else linear between the nearest measured lengths (flat past the longest); a
        fractional length (a mean block) interpolates too."""
        if num_tokens in self.verify_ms:
            return self.verify_ms[num_tokens]
        if num_tokens < 1:
            raise ValueError(f"a forward covers at least 1 token, got {num_tokens}")
        below = max(n for n in self.verify_ms if n < num_tokens)
        above = [n for n in self.verify_ms if n > num_tokens]
        if not above:
            return self.verify_ms[below]
        high = min(above)
        share = (num_tokens - below) / (high - below)
        return self.verify_ms[below] + share * (self.verify_ms[high] - self.verify_ms[below])

    def round_ms(self, gamma: int) -> float:
        return gamma * self.draft_ms_per_token + self.verify_cost(gamma + 1)

    def tokens_per_ms(self, alpha: float, gamma: int) -> float:
        return (1.0 + expected_accepted(alpha, gamma)) / self.round_ms(gamma)


def cost_curve_bound(alpha: float, gamma: float, cost: "CostModel") -> float:
    """The Leviathan bound with this machine's measured verify cost instead of "verifying gamma + 1
    tokens costs one forward": (1 + E[accepted]) / ((gamma d + v(gamma + 1)) / v(1)). measured/this is
    the system's own efficiency, the verify curve taken as given."""
    return (1.0 + expected_accepted(alpha, gamma)) * cost.verify_cost(1) / (
        gamma * cost.draft_ms_per_token + cost.verify_cost(gamma + 1))


def best_block_length(alpha: float, cost: CostModel, candidates: Iterable[int]) -> tuple[int, float]:
    """The block length (0 = target alone) with the most expected tokens per ms, and its predicted
    speedup over the target alone. Ties go to the shorter block (less wasted work)."""
    baseline = cost.tokens_per_ms(alpha, 0)
    best_gamma, best_rate = 0, baseline
    for gamma in sorted(set(candidates)):
        rate = cost.tokens_per_ms(alpha, gamma)
        if rate > best_rate * (1 + 1e-9):
            best_gamma, best_rate = gamma, rate
    return best_gamma, best_rate / baseline


def alpha_from_rounds(rounds: Iterable[tuple[int, int]]) -> float | None:
    """Maximum-likelihood per-token acceptance from (drafted, accepted) rounds: every accepted token
    is a success, a round that stopped early ends in one failure."""
    successes = failures = 0
    for drafted, accepted in rounds:
        successes += accepted
        failures += 1 if accepted < drafted else 0
    total = successes + failures
    return successes / total if total else None
