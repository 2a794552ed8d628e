"""Accept or reject a block of draft tokens against the target.

Given draft tokens d_1..d_g and the target's distributions at the g + 1
positions (after the committed prefix, after d_1, ..., after d_g), return
how many draft tokens are accepted and the one extra token the target
contributes: *recovered* at the first rejection, or *bonus* when all g
are accepted. Every round therefore commits between 1 and g + 1 tokens.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.speculative.params import SamplingParams

from services.speculative.sampling import warp_logits

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Verification:
    num_draft_tokens: int
    num_accepted: int
    next_token_id: int  # recovered (num_accepted < num_draft_tokens) or bonus

    @property
    def is_bonus(self) -> bool:
        return self.num_accepted == self.num_draft_tokens


def _first_false(mask: torch.Tensor) -> int:
    """Length of the all-True prefix of a 1-D bool tensor."""
    return int(mask.to(torch.int64).cumprod(dim=0).sum().item())


def greedy_verify(draft_ids: torch.Tensor, target_logits: torch.Tensor) -> Verification:
    """Accept while draft == target argmax; then the target's argmax."""
    num_draft_tokens = draft_ids.numel()
    assert draft_ids.dim() == 1, f"draft_ids must be [num_draft_tokens], got {tuple(draft_ids.shape)}"
    assert target_logits.shape[0] == num_draft_tokens + 1, (
        f"target_logits must be [num_draft_tokens + 1, vocab], got {tuple(target_logits.shape)}"
    )
    target_ids = target_logits.argmax(dim=-1)  # [num_draft_tokens + 1]
    num_accepted = _first_false(draft_ids == target_ids[:num_draft_tokens])
    return Verification(num_draft_tokens, num_accepted, int(target_ids[num_accepted].item()))


def rejection_sample(
    draft_ids: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> Verification:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

    Accept draft token x with probability min(1, p_target(x) / p_draft(x)); at the
    first rejection sample from normalize(max(0, p_target - p_draft)); if all are
    accepted, sample the bonus token from p_target at the last position.
    `draft_probs=None` means a point mass on each draft token (n-gram drafts).
    """
    num_draft_tokens = draft_ids.numel()
    vocab_size = target_probs.shape[-1]
    assert draft_ids.dim() == 1
    assert target_probs.shape == (num_draft_tokens + 1, vocab_size), (
        f"target_probs must be [num_draft_tokens + 1, vocab], got {tuple(target_probs.shape)}"
    )
    assert draft_probs is None or draft_probs.shape == (num_draft_tokens, vocab_size), (
        f"draft_probs must be [num_draft_tokens, vocab], got {tuple(draft_probs.shape)}"
    )
    positions = torch.arange(num_draft_tokens)
    target_token_probs = target_probs[positions, draft_ids]  # [num_draft_tokens]
    if draft_probs is None:
        draft_token_probs = torch.ones_like(target_token_probs)
    else:
        draft_token_probs = draft_probs[positions, draft_ids]  # [num_draft_tokens]
    # Draw every uniform up front so a seed fixes the whole round.
    uniform = torch.rand(num_draft_tokens, generator=generator)  # [num_draft_tokens]
    # u < p_target / p_draft, written without the division.
    accepted = uniform * draft_token_probs < target_token_probs
    num_accepted = _first_false(accepted)

    if num_accepted == num_draft_tokens:
        next_probs = target_probs[num_accepted]  # [vocab]: bonus
    else:
        if draft_probs is None:
            draft_row = torch.zeros(vocab_size, dtype=target_probs.dtype)
            draft_row[draft_ids[num_accepted]] = 1.0
        else:
            draft_row = draft_probs[num_accepted]
        residual = (target_probs[num_accepted] - draft_row).clamp_min(0.0)  # [vocab]
        total = residual.sum()
        # An all-zero residual means p_target == p_draft, where rejection has
        # probability zero; it can only come from rounding.
        next_probs = residual / total if total > 0 else target_probs[num_accepted]
    next_token = torch.multinomial(next_probs, num_samples=1, generator=generator)
    return Verification(num_draft_tokens, num_accepted, int(next_token.item()))


def match_vocab(draft_probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Pad or cut draft probs [n, draft_vocab] to the target's [n, vocab] (padded embedding rows)."""
    draft_vocab = draft_probs.shape[-1]
    if draft_vocab == vocab_size:
        return draft_probs
    if draft_vocab > vocab_size:
        return draft_probs[:, :vocab_size]
    return torch.nn.functional.pad(draft_probs, (0, vocab_size - draft_vocab))


def verify_block(
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,
    target_logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> Verification:
    """One round's verdict from the target's logits at the block's positions [len(draft_ids) + 1, vocab]:
    greedy_verify, or rejection_sample under the request's warp (applied to both distributions)."""
    draft_tensor = torch.tensor(draft_ids, dtype=torch.long)  # [num_draft_tokens]
    if sampling.greedy:
        return greedy_verify(draft_tensor, target_logits)
    target_probs = warp_logits(target_logits, sampling)  # [num_draft_tokens + 1, vocab]
    if draft_probs is not None:
        draft_probs = match_vocab(draft_probs, target_probs.shape[-1])
    return rejection_sample(draft_tensor, draft_probs, target_probs, generator)
