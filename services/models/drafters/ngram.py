"""Prompt-lookup drafting: no model, propose what followed the last n tokens earlier in the context."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from services.models.drafters.base import DraftProposal
from services.speculative.params import SamplingParams

logger = logging.getLogger(__name__)


def find_ngram_continuation(
    context_ids: torch.Tensor, num_draft_tokens: int, ngram_max: int, ngram_min: int
) -> list[int]:
    """Match the last n tokens (n from ngram_max down to ngram_min) earlier in the context
    and return up to num_draft_tokens tokens that followed the match.

    Among matches of the longest n, the most recent one that still has
    num_draft_tokens tokens after it wins (recent text predicts best);
    failing that, the earliest (the longest continuation).
    """
    assert context_ids.dim() == 1
    length = context_ids.numel()
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        suffix = context_ids[-n:]  # [n]
        windows = context_ids[:-1].unfold(0, n, 1)  # [length - n, n]: excludes the suffix itself
        starts = torch.nonzero((windows == suffix).all(dim=1)).flatten()
        if starts.numel() == 0:
            continue
        full = starts[starts + n + num_draft_tokens <= length]
        follow = int((full[-1] if full.numel() else starts[0]).item()) + n
        return context_ids[follow : follow + num_draft_tokens].tolist()
    return []


class NgramDrafter:
    def __init__(self, *, ngram_max: int = 4, ngram_min: int = 2) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.name = "ngram"
        self.ngram_max = ngram_max
        self.ngram_min = ngram_min

    def propose(
        self,
        context_ids: Sequence[int],
        num_draft_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        if num_draft_tokens <= 0 or len(context_ids) < 2:
            return DraftProposal([], None)
        context = torch.as_tensor(list(context_ids), dtype=torch.long)
        draft_ids = find_ngram_continuation(context, num_draft_tokens, self.ngram_max, self.ngram_min)
        return DraftProposal(draft_ids, None)  # a point mass on each proposed token

    def release(self) -> None:
        pass
