"""The Leviathan et al. (2023) speedup bound, and the per-token acceptance it assumes.

With per-token acceptance alpha (i.i.d.), block length gamma and cost ratio
c = (draft time per token) / (target time per forward), one round yields on
average (1 - alpha^(gamma+1)) / (1 - alpha) tokens for (gamma c + 1) target
forwards' worth of time, so the ideal speedup over target-only decoding is

    S(alpha, gamma, c) = (1 - alpha^(gamma+1)) / ((1 - alpha) (gamma c + 1)).

It assumes verifying gamma + 1 tokens costs one forward and nothing else
(no transport, no bookkeeping): measured / S is the system's efficiency.
alpha is not the raw accepted/drafted ratio (positions after a rejection
count as drafted but never had a chance); it is solved from the measured
mean accepted tokens per drafted round, so S's tokens per round equals the
measured tokens per round.
"""

from __future__ import annotations


def expected_accepted(alpha: float, gamma: float) -> float:
    """Mean accepted draft tokens per round: alpha + alpha^2 + ... + alpha^gamma."""
    if alpha >= 1.0:
        return gamma
    return alpha * (1.0 - alpha**gamma) / (1.0 - alpha)


def alpha_from_mean_accepted(mean_accepted: float, gamma: float, *, tolerance: float = 1e-9) -> float:
    """Invert expected_accepted(alpha, gamma) = mean_accepted by bisection (it is increasing in alpha)."""
    if gamma <= 0:
        raise ValueError(f"gamma must be positive, got {gamma}")
    if not 0.0 <= mean_accepted <= gamma:
        raise ValueError(f"mean accepted tokens {mean_accepted} is outside [0, gamma={gamma}]")
    low, high = 0.0, 1.0
    while high - low > tolerance:
        middle = (low + high) / 2
        if expected_accepted(middle, gamma) < mean_accepted:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def leviathan_speedup(alpha: float, gamma: float, cost_ratio: float) -> float:
    """S(alpha, gamma, c) above: the ideal speedup over target-only decoding."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if cost_ratio < 0 or gamma < 0:
        raise ValueError(f"need gamma >= 0 and cost ratio >= 0, got {gamma}, {cost_ratio}")
    return (1.0 + expected_accepted(alpha, gamma)) / (gamma * cost_ratio + 1.0)
