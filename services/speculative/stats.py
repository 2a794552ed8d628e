"""Speculative-decoding counters, collected here and exported elsewhere (CLI JSON, Prometheus).

Names follow vLLM's spec-decode metrics: num_drafts, num_draft_tokens,
num_accepted_tokens, num_accepted_tokens_per_pos.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class SpecDecodingStats:
    num_target_calls: int = 0  # rounds, with or without a draft
    num_drafts: int = 0  # rounds that verified >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + recovered/bonus, before stop handling
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        """Record one round: num_draft_tokens proposed, the first num_accepted kept."""
        assert 0 <= num_accepted <= num_draft_tokens
        self.num_target_calls += 1
        self.num_emitted_tokens += num_accepted + 1
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        grow = num_draft_tokens - len(self.num_draft_tokens_per_pos)
        if grow > 0:
            self.num_draft_tokens_per_pos.extend([0] * grow)
            self.num_accepted_tokens_per_pos.extend([0] * grow)
        for pos in range(num_draft_tokens):
            self.num_draft_tokens_per_pos[pos] += 1
            if pos < num_accepted:
                self.num_accepted_tokens_per_pos[pos] += 1

    def merge(self, other: "SpecDecodingStats") -> None:
        self.num_target_calls += other.num_target_calls
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        self.num_emitted_tokens += other.num_emitted_tokens
        for mine, theirs in (
            (self.num_draft_tokens_per_pos, other.num_draft_tokens_per_pos),
            (self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for pos, count in enumerate(theirs):
                mine[pos] += count

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts: tokens per drafted round, counting the recovered or bonus token."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def tokens_per_target_call(self) -> float:
        """emitted / rounds, over every round including target-only ones."""
        return self.num_emitted_tokens / self.num_target_calls if self.num_target_calls else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """accepted at position i / drafted at position i."""
        return [
            accepted / drafted if drafted else 0.0
            for accepted, drafted in zip(self.num_accepted_tokens_per_pos, self.num_draft_tokens_per_pos)
        ]

    def to_dict(self) -> dict:
        return {
            "num_target_calls": self.num_target_calls,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_emitted_tokens": self.num_emitted_tokens,
            "num_draft_tokens_per_pos": list(self.num_draft_tokens_per_pos),
            "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "mean_acceptance_length": self.mean_acceptance_length,
            "tokens_per_target_call": self.tokens_per_target_call,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SpecDecodingStats":
        """Inverse of to_dict (the derived rates are recomputed, not read)."""
        return cls(**{item.name: data[item.name] for item in fields(cls)})
