"""The logits -> probabilities warp and the samplers shared by draft and target (the params: params.py).

Lossless sampling needs the *same* warp (temperature, then top-k, then
top-p, as transformers orders them) applied to both distributions: the
rejection sampler then reproduces the warped target distribution exactly.
"""

from __future__ import annotations

import logging

import torch

from services.speculative.params import SamplingParams

logger = logging.getLogger(__name__)


def warp_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [num_positions, vocab] -> warped probabilities [num_positions, vocab] (float32)."""
    assert logits.dim() == 2, f"expected [num_positions, vocab], got {tuple(logits.shape)}"
    assert not params.greedy, "greedy decoding takes the argmax, not a warped distribution"
    scores = logits.float() / params.temperature
    vocab_size = scores.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth_best = torch.topk(scores, params.top_k, dim=-1).values[:, -1:]  # [num_positions, 1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=True)
        sorted_probs = sorted_scores.softmax(dim=-1)
        # Drop a token when the mass of the better tokens already reaches top_p;
        # the best token always survives.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[:, 0] = False  # rounding in the cumsum must not drop it under a tiny top_p
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return scores.softmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Probabilities [num_positions, vocab] -> token ids [num_positions]."""
    assert probs.dim() == 2, f"expected [num_positions, vocab], got {tuple(probs.shape)}"
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
