"""The drafter interface shared by model, n-gram and self drafts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from services.speculative.params import SamplingParams


@dataclass
class DraftProposal:
    token_ids: list[int]  # [num_draft_tokens], may be shorter than asked, even empty
    probs: torch.Tensor | None  # [num_draft_tokens, vocab] warped draft probs; None = point mass
    drafter: str = ""  # who made it, where stats count it apart (services/speculative/stats.py: "suffix", "history")

    @property
    def num_draft_tokens(self) -> int:
        return len(self.token_ids)


def block_probs(per_token: list[torch.Tensor | None], token_ids: list[int]) -> torch.Tensor | None:
    """One block's draft probs [len(token_ids), vocab] from per-token rows, where None is a point mass on
    that token (prompt lookup); None when every token is a point mass. A block drafted in pieces (a guess,
    a speculation, a top-up, lookup and model tokens mixed) keeps each row on its own token."""
    assert len(per_token) == len(token_ids), f"{len(per_token)} probability rows for {len(token_ids)} tokens"
    known = [row for row in per_token if row is not None]
    if not known:
        return None
    rows = []
    for row, token_id in zip(per_token, token_ids):
        if row is None:
            row = torch.zeros_like(known[0])
            row[token_id] = 1.0
        rows.append(row)
    return torch.stack(rows)


def per_token_probs(proposal: DraftProposal) -> list[torch.Tensor | None]:
    """A proposal's probs as one entry per token (None: a point mass)."""
    if proposal.probs is None:
        return [None] * proposal.num_draft_tokens
    return list(proposal.probs)


def reads_prompt(drafter) -> bool:
    """Whether the drafter must read (prefill) the prompt before it drafts: a model draft stepped token by token
    (`stepwise`), or a per-round choice with a model half (`needs_prefill`). Such a session opens with a
    target-only round while the draft reads (services/speculative/block_length.py opens_plain)."""
    return bool(getattr(drafter, "stepwise", False) or getattr(drafter, "needs_prefill", False))


def longer_allowed(drafter, max_draft_tokens: int | None) -> dict:
    """propose()'s keyword for a drafter that may propose more than it was asked (`extends = True`: a suffix
    draft, free to draft and sure of a long match), up to max_draft_tokens (the request's end, the context's
    room); nothing for the others."""
    if max_draft_tokens is None or not getattr(drafter, "extends", False):
        return {}
    return {"max_draft_tokens": max_draft_tokens}


class Drafter(Protocol):
    """Per-session drafter: stateful (caches) but driven only by the committed context."""

    name: str
    # Optional `stepwise = True`: drafting n tokens in one call equals n one-token calls, so pipelined
    # drafting may stop between tokens (services/engine/draft_pipeline.py).

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
