"""The drafter interface shared by model, n-gram and self drafts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.speculative.sampling import SamplingParams


@dataclass
class DraftProposal:
    token_ids: list[int]  # [num_draft_tokens], may be shorter than asked, even empty
    probs: torch.Tensor | None  # [num_draft_tokens, vocab] warped draft probs; None = point mass

    @property
    def num_draft_tokens(self) -> int:
        return len(self.token_ids)


class Drafter(Protocol):
    """Per-session drafter: stateful (caches) but driven only by the committed context."""

    name: str
    # Optional `stepwise = True`: drafting n tokens in one call equals n one-token calls, so pipelined
    # drafting may stop between tokens (draft_worker/pipeline.py).

    def propose(
        self,
        context_ids: Sequence[int],
        num_draft_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        """Propose up to num_draft_tokens tokens to follow context_ids (prompt + committed output)."""
        ...

    def release(self) -> None:
        """Free per-session state (KV cache)."""
        ...
