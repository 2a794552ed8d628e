"""Per-request decoding options, validated once and passed whole."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from services.config import SpeculativeSettings
from services.speculative.cost_model import CostModel
from services.speculative.params import SamplingParams


@dataclass(frozen=True)
class GenerationOptions:
    sampling: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 128
    stop: Sequence[str] = ()
    speculative: SpeculativeSettings = field(default_factory=SpeculativeSettings)
    num_draft_tokens: int | None = None  # initial gamma; None = speculative.num_draft_tokens
    ignore_eos: bool = False
    chunk_size: int = 512  # prefill chunk
    cost: CostModel | None = None  # measured round costs, for speculative.block_policy "cost"

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size!r}")
