"""A causal LM's KV cache that remembers which token ids it holds, so it rolls back instead of recomputing."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from services.models.loading import LoadedModel

logger = logging.getLogger(__name__)


def common_prefix_length(left: Sequence[int], right: Sequence[int]) -> int:
    limit = min(len(left), len(right))
    for index in range(limit):
        if left[index] != right[index]:
            return index
    return limit


class CachedLM:
    """A model plus one sequence's KV cache; `cached_ids` are the tokens the cache covers."""

    def __init__(self, loaded: LoadedModel, chunk_size: int = 512) -> None:
        self.loaded = loaded
        self.chunk_size = chunk_size
        self.cache = DynamicCache(config=loaded.config)
        self.cached_ids: list[int] = []

    @property
    def num_cached(self) -> int:
        return len(self.cached_ids)

    def crop(self, length: int) -> None:
        """Keep the first `length` cached tokens (transformers 5: crop takes a negative count)."""
        assert 0 <= length <= self.num_cached, f"cannot crop {self.num_cached} cached tokens to {length}"
        if length < self.num_cached:
            self.cache.crop(length - self.num_cached)
            del self.cached_ids[length:]

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], num_logits: int) -> torch.Tensor:
        """Append token_ids to the cache; return float32 logits for the last num_logits positions.

        Long inputs are fed in chunks of chunk_size so a long prompt never
        materialises a [prompt, prompt] attention matrix at once.
        """
        assert 1 <= num_logits <= len(token_ids), f"num_logits {num_logits} for {len(token_ids)} tokens"
        logits: torch.Tensor | None = None
        device = self.loaded.device
        for start in range(0, len(token_ids), self.chunk_size):
            chunk = list(token_ids[start : start + self.chunk_size])
            remaining_after = len(token_ids) - start - len(chunk)
            keep = max(0, num_logits - remaining_after)
            input_ids = torch.tensor([chunk], dtype=torch.long, device=device)  # [1, chunk]
            output = self.loaded.model(
                input_ids=input_ids,
                cache=self.cache,
                use_cache=True,
                logits_to_keep=max(keep, 1),
            )
            self.cached_ids.extend(chunk)
            if keep:
                chunk_logits = output.logits[0, -keep:].float()  # [keep, vocab]
                logits = chunk_logits if logits is None else torch.cat([logits, chunk_logits])
        assert logits is not None and logits.shape[0] == num_logits
        return logits

    def sync(self, context_ids: Sequence[int]) -> torch.Tensor:
        """Make the cache hold context_ids; return next-token logits [vocab] after them.

        Reuses the longest common prefix with what is cached, so a rejected
        draft costs a crop, not a recompute.
        """
        assert len(context_ids) >= 1, "need at least one token of context"
        keep = min(common_prefix_length(self.cached_ids, context_ids), len(context_ids) - 1)
        self.crop(keep)
        return self.forward(context_ids[keep:], num_logits=1)[0]
