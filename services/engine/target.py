"""The target side of a session: its KV cache, the committed tokens, and one verification per round."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from services.errors import ContextLengthError
from services.models.kv_cache import CachedLM
from services.models.loading import LoadedModel
from services.speculative.sampling import SamplingParams, warp_logits
from services.speculative.verification import Verification, greedy_verify, rejection_sample

logger = logging.getLogger(__name__)


def match_vocab(draft_probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Pad or cut draft probs [n, draft_vocab] to the target's [n, vocab] (padded embedding rows)."""
    draft_vocab = draft_probs.shape[-1]
    if draft_vocab == vocab_size:
        return draft_probs
    if draft_vocab > vocab_size:
        return draft_probs[:, :vocab_size]
    return torch.nn.functional.pad(draft_probs, (0, vocab_size - draft_vocab))


def check_request_fits(model_name: str, max_context: int, num_prompt_tokens: int, max_new_tokens: int = 0) -> None:
    """The one context-window rule, used by the engine and by the gateway before any worker sees a request."""
    if num_prompt_tokens == 0:
        raise ValueError("prompt is empty: need at least one token")
    if num_prompt_tokens >= max_context:
        raise ContextLengthError(
            f"prompt of {num_prompt_tokens} tokens does not fit {model_name!r}'s context of {max_context} tokens"
        )
    if num_prompt_tokens + max_new_tokens > max_context:
        raise ContextLengthError(
            f"prompt of {num_prompt_tokens} tokens + max_new_tokens {max_new_tokens} exceeds "
            f"{model_name!r}'s context of {max_context} tokens"
        )


class TargetSession:
    """Invariant: the KV cache holds every committed token but the last, which the
    next round feeds together with the draft block."""

    def __init__(self, target: LoadedModel, prompt_ids: Sequence[int], *, chunk_size: int = 512) -> None:
        check_request_fits(target.name, target.max_context, len(prompt_ids))
        self.target = target
        self.token_ids: list[int] = list(prompt_ids)
        self._lm = CachedLM(target, chunk_size)
        if len(prompt_ids) > 1:
            self._lm.forward(prompt_ids[:-1], num_logits=1)

    @property
    def num_cached(self) -> int:
        """Tokens held in the KV cache."""
        return self._lm.num_cached

    @property
    def room(self) -> int:
        """Draft tokens that still fit the context this round."""
        return self.target.max_context - len(self.token_ids)

    def verify(
        self,
        draft_ids: Sequence[int],
        draft_probs: torch.Tensor | None,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> Verification:
        """One target forward over [last committed, *draft_ids]; commit accepted + one token."""
        num_draft_tokens = len(draft_ids)
        assert num_draft_tokens <= self.room, f"{num_draft_tokens} draft tokens overflow the context"
        num_committed = len(self.token_ids)
        target_logits = self._lm.forward([self.token_ids[-1], *draft_ids], num_logits=num_draft_tokens + 1)
        draft_tensor = torch.tensor(list(draft_ids), dtype=torch.long)  # [num_draft_tokens]
        if sampling.greedy:
            verification = greedy_verify(draft_tensor, target_logits)
        else:
            target_probs = warp_logits(target_logits, sampling)  # [num_draft_tokens + 1, vocab]
            if draft_probs is not None:
                draft_probs = match_vocab(draft_probs, target_probs.shape[-1])
            verification = rejection_sample(draft_tensor, draft_probs, target_probs, generator)
        num_accepted = verification.num_accepted
        # Cache holds committed[:-1] + last + draft; keep through the accepted ones.
        self._lm.crop(num_committed + num_accepted)
        self.token_ids.extend(draft_ids[:num_accepted])
        self.token_ids.append(verification.next_token_id)
        return verification

    def rollback(self, num_committed: int) -> None:
        """Forget everything committed after the first num_committed tokens (keeps the cache invariant)."""
        assert 1 <= num_committed <= len(self.token_ids), f"cannot roll back to {num_committed} tokens"
        self._lm.crop(num_committed - 1)
        del self.token_ids[num_committed:]

    def release(self) -> None:
        self._lm.crop(0)
