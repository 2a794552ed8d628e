"""A synthetic drafter for systems benchmarking: acceptance chosen, not earned.

`synthetic:0.7` proposes the target's own greedy continuation token with
probability 0.7 and a wrong token otherwise, so a bench can read the
suite's overhead (and measured/bound) at a chosen acceptance whatever the
draft quality; with random-weight models it times a system whose real
weights cannot travel. The target's greedy continuation comes from a
reference run (the bench's `ar` mode) registered per prompt. It costs
almost nothing to run. Never a default, and labelled synthetic in reports.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence

import torch

from services.models.drafters.base import DraftProposal
from services.speculative.sampling import SamplingParams

logger = logging.getLogger(__name__)

SYNTHETIC_PREFIX = "synthetic:"


def parse_synthetic_acceptance(spec: str) -> float:
    """`synthetic:0.7` -> 0.7; the value must be a probability."""
    text = spec[len(SYNTHETIC_PREFIX):]
    try:
        acceptance = float(text)
    except ValueError:
        raise ValueError(f"draft {spec!r}: {text!r} is not a number (use e.g. synthetic:0.7)") from None
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"draft {spec!r}: acceptance {acceptance} is outside [0, 1]")
    return acceptance


class ReferenceBook:
    """Reference sequences (prompt + the target's greedy output), found by the prompt they start with."""

    def __init__(self) -> None:
        self._by_prompt: dict[tuple[int, ...], list[int]] = {}

    def add(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self._by_prompt[tuple(prompt_ids)] = [*prompt_ids, *output_ids]

    def find(self, context_ids: Sequence[int]) -> list[int] | None:
        for prompt, reference in self._by_prompt.items():
            if len(context_ids) >= len(prompt) and tuple(context_ids[: len(prompt)]) == prompt:
                return reference
        return None

    def __len__(self) -> int:
        return len(self._by_prompt)


class SyntheticDrafter:
    def __init__(self, acceptance: float, references: ReferenceBook, *, vocab_size: int, seed: int = 0) -> None:
        self.name = f"{SYNTHETIC_PREFIX}{acceptance:g}"
        self.acceptance = acceptance
        self.references = references
        self.vocab_size = vocab_size
        self.seed = seed
        self._rng = random.Random(seed)  # reseeded per prompt at the first proposal
        self._reference: list[int] | None = None

    def propose(
        self,
        context_ids: Sequence[int],
        num_draft_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        if self._reference is None:
            self._reference = self.references.find(context_ids)
            if self._reference is None:
                raise ValueError("synthetic draft: no reference run for this prompt (run the ar mode first)")
            # independent draws per prompt (one shared sequence would correlate every prompt's rounds)
            self._rng = random.Random(f"{self.seed}:{len(context_ids)}:{context_ids[-8:]}")
        start = len(context_ids)
        truth = self._reference[start : start + num_draft_tokens]
        draft_ids = [
            token if self._rng.random() < self.acceptance else (token + 1) % self.vocab_size for token in truth
        ]
        return DraftProposal(draft_ids, None)  # a point mass, like prompt lookup

    def release(self) -> None:
        self._reference = None
