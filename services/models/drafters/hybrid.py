"""Prompt lookup when the context offers a match, the model draft otherwise.

Grounded prompts (summaries, rewrites, code edits) repeat their context and
prompt lookup drafts long accepted runs for free; open chat rarely does, and
a model draft covers it. The model drafter's cache catches up on the tokens
it skipped the next time it is asked (one forward over them).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from services.models.drafters.base import DraftProposal, Drafter
from services.models.drafters.ngram import NgramDrafter
from services.speculative.params import SamplingParams

logger = logging.getLogger(__name__)


class HybridDrafter:
    def __init__(self, lookup: NgramDrafter, model: Drafter, *, name: str = "hybrid") -> None:
        self.name = name
        self.lookup = lookup
        self.model = model
        self.num_lookup_rounds = 0
        self.num_model_rounds = 0

    def propose(
        self,
        context_ids: Sequence[int],
        num_draft_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        proposal = self.propose_lookup(context_ids, num_draft_tokens, sampling, generator)
        if proposal is not None:
            return proposal
        return self.model.propose(context_ids, num_draft_tokens, sampling, generator)

    def propose_lookup(
        self,
        context_ids: Sequence[int],
        num_draft_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal | None:
        """Prompt lookup's proposal, or None when the model draft should propose (batched drafting asks
        the model half of many hybrids together)."""
        proposal = self.lookup.propose(context_ids, num_draft_tokens, sampling, generator)
        if proposal.num_draft_tokens > 0:
            self.num_lookup_rounds += 1
            return proposal
        self.num_model_rounds += 1
        return None

    def release(self) -> None:
        self.lookup.release()
        self.model.release()
