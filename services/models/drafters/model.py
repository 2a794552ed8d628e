"""A causal LM as the draft: small model, or a reduced-precision copy of the target (self-draft)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from services.models.drafters.base import DraftProposal
from services.models.kv_cache import CachedLM
from services.models.loading import LoadedModel
from services.speculative.params import SamplingParams
from services.speculative.processing import DraftProcessing
from services.speculative.sampling import sample_from_probs, warp_logits

logger = logging.getLogger(__name__)


class ModelDrafter:
    stepwise = True  # propose(ctx, n) == n calls of propose(ctx + drafted, 1): its KV cache carries over

    def __init__(self, loaded: LoadedModel, *, chunk_size: int = 512, name: str | None = None) -> None:
        self.name = name or loaded.name
        self._lm = CachedLM(loaded, chunk_size)

    @property
    def max_context(self) -> int:
        return self._lm.loaded.max_context

    def propose(
        self,
        context_ids: Sequence[int],
        num_draft_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        num_draft_tokens = min(num_draft_tokens, self.max_context - len(context_ids))
        if num_draft_tokens <= 0:
            return DraftProposal([], None)
        logits = self._lm.sync(context_ids)  # [vocab]
        processing = DraftProcessing(context_ids, sampling, logits.shape[-1]) if DraftProcessing.needed(sampling) \
            else None
        draft_ids: list[int] = []
        draft_probs: list[torch.Tensor] = []
        for position in range(num_draft_tokens):
            if processing is not None:
                logits = processing.apply(logits)
            if sampling.greedy:
                token_id = int(logits.argmax().item())
            else:
                probs = warp_logits(logits[None], sampling)  # [1, vocab]
                token_id = int(sample_from_probs(probs, generator).item())
                draft_probs.append(probs[0])
            draft_ids.append(token_id)
            if processing is not None:
                processing.add(token_id)
            if position + 1 < num_draft_tokens:
                logits = self._lm.forward([token_id], num_logits=1)[0]
        probs_out = torch.stack(draft_probs) if draft_probs else None  # [num_draft_tokens, vocab]
        return DraftProposal(draft_ids, probs_out)

    def release(self) -> None:
        self._lm.crop(0)


class SelfDrafter(ModelDrafter):
    """The target drafting for itself at reduced precision: int8 (the CPU path), bf16 or fp16.

    Same tokenizer by construction; the copy is made once per process and
    shared by sessions through DraftSource.
    """

    def __init__(self, target: LoadedModel, precision: str = "int8", *, chunk_size: int = 512) -> None:
        super().__init__(target.with_precision(precision), chunk_size=chunk_size, name=precision)
