"""Sampling parameters and the logits -> probabilities warp shared by draft and target.

Lossless sampling needs the *same* warp (temperature, then top-k, then
top-p, as transformers orders them) applied to both distributions: the
rejection sampler then reproduces the warped target distribution exactly.
"""

from __future__ import annotations

import hashlib

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)


GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 means no top-k; seed None means random."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW are greedy (as in vLLM): dividing logits by 1e-300 gives inf - inf."""
        return self.temperature < GREEDY_BELOW

    def make_generator(self, offset: int = 0, device: str | torch.device = "cpu") -> torch.Generator:
        """A seeded generator; `offset` separates the draft's stream from the target's."""
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed((self.seed + offset) % 2**64)
        return generator

    def make_stream(self, role: str, index: int = 0, device: str | torch.device = "cpu") -> torch.Generator:
        """A seeded generator for one named stream, e.g. ("draft", round 7): distinct (role, index)
        pairs never share random numbers (seed + offset schemes collide across processes)."""
        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            digest = hashlib.blake2b(f"{self.seed}:{role}:{index}".encode(), digest_size=8).digest()
            generator.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        return generator


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
