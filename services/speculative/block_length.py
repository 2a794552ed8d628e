"""Per-session block length (gamma) from recent acceptance, and the fallback to target-only.

Rule (DESIGN.md): over the last `window` drafted rounds, acceptance above
`raise_above` grows gamma by `raise_step` (up to the max), anything else
shrinks it by `lower_step` (down to the min). When acceptance over at least
`fallback_min_rounds` drafted rounds is below `fallback_below`, the session
decodes with the target alone; after `probe_after_rounds` such rounds it
drafts again at the minimum gamma with a fresh window (0 disables probing).
"""

from __future__ import annotations

import copy
import logging
from collections import deque

from services.config import SpeculativeSettings
from services.speculative.cost_model import CostModel, alpha_from_rounds, best_block_length

logger = logging.getLogger(__name__)


def next_block_length(current: int, window_acceptance: float, config: SpeculativeSettings) -> int:
    """The controller's rule as a pure function."""
    if window_acceptance > config.raise_above:
        return min(current + config.raise_step, config.max_draft_tokens)
    return max(current - config.lower_step, config.min_draft_tokens)


class BlockLengthController:
    """Gamma from recent acceptance; with a cost model (block_policy "cost"), the gamma with the most
    expected tokens per ms for the measured acceptance, where gamma 0 (target alone) also competes."""

    def __init__(self, config: SpeculativeSettings, num_draft_tokens: int | None = None,
                 cost: CostModel | None = None) -> None:
        self.config = config
        self.cost = cost
        start = config.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        self._gamma = max(config.min_draft_tokens, min(start, config.max_draft_tokens))
        self._window: deque[tuple[int, int]] = deque(maxlen=config.window)  # (drafted, accepted)
        self._fallback_rounds_left = 0
        self.num_fallbacks = 0

    @property
    def fallen_back(self) -> bool:
        return self._fallback_rounds_left > 0

    @property
    def num_draft_tokens(self) -> int:
        """Tokens to draft next round; 0 while decoding with the target alone."""
        return 0 if self.fallen_back else self._gamma

    @property
    def window_acceptance(self) -> float:
        drafted = sum(d for d, _ in self._window)
        return sum(a for _, a in self._window) / drafted if drafted else 0.0

    def update(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Feed one finished round."""
        if num_draft_tokens == 0:
            # A target-only round (fallback, or a drafter with nothing to say).
            if self._fallback_rounds_left > 0:
                self._fallback_rounds_left -= 1
                if self._fallback_rounds_left == 0:
                    self._window.clear()
                    self._gamma = self.config.min_draft_tokens
            return
        self._window.append((num_draft_tokens, num_accepted))
        acceptance = self.window_acceptance
        enough = len(self._window) >= self.config.fallback_min_rounds
        if enough and acceptance < self.config.fallback_below:
            self._enter_fallback(acceptance)
            return
        if self.cost is None:
            self._gamma = next_block_length(self._gamma, acceptance, self.config)
            return
        alpha = alpha_from_rounds(self._window) or 0.0
        gamma, _ = best_block_length(alpha, self.cost, range(self.config.min_draft_tokens,
                                                             self.config.max_draft_tokens + 1))
        if gamma == 0 and enough:  # no block length pays for itself here: decode with the target alone
            self._enter_fallback(acceptance)
            return
        self._gamma = max(gamma, self.config.min_draft_tokens)

    def after(self, num_draft_tokens: int, num_accepted: int) -> int:
        """num_draft_tokens next round if this round ended so; the controller itself is unchanged."""
        future = copy.copy(self)
        future._window = deque(self._window, maxlen=self._window.maxlen)
        future.update(num_draft_tokens, num_accepted)
        return future.num_draft_tokens

    def _enter_fallback(self, acceptance: float) -> None:
        self.num_fallbacks += 1
        probe = self.config.probe_after_rounds
        # With probing disabled the fallback lasts for the rest of the session.
        self._fallback_rounds_left = probe if probe > 0 else 1 << 62
        logger.debug("acceptance %.2f below %.2f: target-only decoding", acceptance, self.config.fallback_below)
