"""Speculative-decoding counters, collected here and exported elsewhere (CLI JSON, Prometheus).

Names follow vLLM's spec-decode metrics: num_drafts, num_draft_tokens,
num_accepted_tokens, num_accepted_tokens_per_pos.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields


def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..1) of the values, None when there are none: the one every figure
    (bench, heartbeats, summaries) uses."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else None


SUFFIX_DRAFTER = "suffix"  # a block from the session's own context (DraftProposal.drafter, DraftBlock.drafter)
HISTORY_DRAFTER = "history"  # a block from the tenant's earlier outputs
SUFFIX_DRAFTERS = (SUFFIX_DRAFTER, HISTORY_DRAFTER)
FORCED_DRAFTER = "forced"  # a block of tokens a grammar forced (services/speculative/grammar.py)


def model_round(drafter: str, num_draft_tokens: int, num_accepted: int) -> tuple[int, int]:
    """A round as the model draft's block-length controller counts it: a suffix draft's as a target-only round
    (free, and judged by its own measure), any other as it was."""
    return (0, 0) if drafter in (*SUFFIX_DRAFTERS, FORCED_DRAFTER) else (num_draft_tokens, num_accepted)


@dataclass
class SpecDecodingStats:
    num_target_calls: int = 0  # rounds, with or without a draft
    num_drafts: int = 0  # rounds that verified >= 1 draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + recovered/bonus, before stop handling
    num_draft_tokens_per_pos: list[int] = field(default_factory=list)
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # of the above, the rounds whose block a suffix draft made (drafters/suffix.py; the rest: the model draft, or
    # prompt lookup), and of those the ones from the tenant's earlier outputs (the fleet's history)
    num_suffix_drafts: int = 0
    num_suffix_draft_tokens: int = 0
    num_suffix_accepted_tokens: int = 0
    num_history_drafts: int = 0
    # of the above, the tokens a grammar forced (structured output), drafted for free, and those accepted
    num_forced_draft_tokens: int = 0
    num_forced_accepted_tokens: int = 0

    def observe(self, num_draft_tokens: int, num_accepted: int, drafter: str = "", num_forced: int = 0,
                num_forced_accepted: int = 0) -> None:
        """Record one round: num_draft_tokens proposed, the first num_accepted kept; drafter: which drafter made
        the block (SUFFIX_DRAFTERS count apart); num_forced: how many of its tokens a grammar forced, and of those
        num_forced_accepted were kept."""
        assert 0 <= num_accepted <= num_draft_tokens and 0 <= num_forced_accepted <= num_forced <= num_draft_tokens
        self.num_forced_draft_tokens += num_forced
        self.num_forced_accepted_tokens += num_forced_accepted
        self.num_target_calls += 1
        self.num_emitted_tokens += num_accepted + 1
        if num_draft_tokens == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        self._count_drafter(drafter, num_draft_tokens, num_accepted)
        self._count_positions(num_draft_tokens, num_accepted)

    def _count_drafter(self, drafter: str, num_draft_tokens: int, num_accepted: int) -> None:
        if drafter in SUFFIX_DRAFTERS:
            self.num_suffix_drafts += 1
            self.num_suffix_draft_tokens += num_draft_tokens
            self.num_suffix_accepted_tokens += num_accepted
            self.num_history_drafts += drafter == HISTORY_DRAFTER

    def observe_checked(self, num_draft_tokens: int, num_accepted: int, *, ends_draft: bool,
                        drafter: str = "") -> None:
        """Draft tokens checked against tokens the target committed on its own while they were on their way
        (services/speculative/bridging.py): drafted and, the first num_accepted, accepted, in no target call of
        their own. ends_draft: the block ends there (it counts as a draft); else the round verifying the
        rest of it does (and counts its positions from 0 again)."""
        assert 0 <= num_accepted <= num_draft_tokens
        if num_draft_tokens == 0:
            return
        self.num_drafts += int(ends_draft)
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        if drafter in SUFFIX_DRAFTERS:
            self.num_suffix_drafts += int(ends_draft)
            self.num_suffix_draft_tokens += num_draft_tokens
            self.num_suffix_accepted_tokens += num_accepted
            self.num_history_drafts += int(ends_draft and drafter == HISTORY_DRAFTER)
        self._count_positions(num_draft_tokens, num_accepted)

    def _count_positions(self, num_draft_tokens: int, num_accepted: int) -> None:
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
        self.num_suffix_drafts += other.num_suffix_drafts
        self.num_suffix_draft_tokens += other.num_suffix_draft_tokens
        self.num_suffix_accepted_tokens += other.num_suffix_accepted_tokens
        self.num_history_drafts += other.num_history_drafts
        self.num_forced_draft_tokens += other.num_forced_draft_tokens
        self.num_forced_accepted_tokens += other.num_forced_accepted_tokens
        for mine, theirs in (
            (self.num_draft_tokens_per_pos, other.num_draft_tokens_per_pos),
            (self.num_accepted_tokens_per_pos, other.num_accepted_tokens_per_pos),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for pos, count in enumerate(theirs):
                mine[pos] += count

    ROW_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # what a request's SQL row keeps

    def row_counters(self) -> dict[str, int]:
        """The counters a request's SQL row keeps (services/storage/tables.py); rates come from them again
        through from_row_counters, never computed elsewhere."""
        return {name: getattr(self, name) for name in self.ROW_COUNTERS}

    @classmethod
    def from_row_counters(cls, row) -> "SpecDecodingStats":
        return cls(**{name: getattr(row, name) or 0 for name in cls.ROW_COUNTERS})

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
            "num_suffix_drafts": self.num_suffix_drafts,
            "num_suffix_draft_tokens": self.num_suffix_draft_tokens,
            "num_suffix_accepted_tokens": self.num_suffix_accepted_tokens,
            "num_history_drafts": self.num_history_drafts,
            "num_forced_draft_tokens": self.num_forced_draft_tokens,
            "num_forced_accepted_tokens": self.num_forced_accepted_tokens,
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SpecDecodingStats":
        """Inverse of to_dict (the derived rates are recomputed, not read)."""
        return cls(**{item.name: data.get(item.name, 0) for item in fields(cls)})

    def to_wire(self) -> dict:
        """The counters alone (services/protocol.py carries them whole in events and verdicts)."""
        return {item.name: getattr(self, item.name) for item in fields(self)}

    @classmethod
    def from_wire(cls, data: dict) -> "SpecDecodingStats":
        """Inverse of to_wire; missing counters are 0, unknown ones ignored, wrong types a ValueError."""
        values = {}
        for item in fields(cls):
            if item.name not in data:
                continue
            value = data[item.name]
            if item.name.endswith("_per_pos"):
                if not isinstance(value, list) or not all(isinstance(v, int) and v >= 0 for v in value):
                    raise ValueError(f"stats.{item.name} must be a list of counts, got {value!r}")
            elif not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"stats.{item.name} must be a count, got {value!r}")
            values[item.name] = value
        return cls(**values)

    def minus(self, earlier: "SpecDecodingStats") -> tuple[int, int]:
        """(draft tokens, accepted tokens) counted since `earlier`, a snapshot of the same request."""
        return (self.num_draft_tokens - earlier.num_draft_tokens,
                self.num_accepted_tokens - earlier.num_accepted_tokens)

    def copy(self) -> "SpecDecodingStats":
        return SpecDecodingStats.from_wire({name: list(value) if isinstance(value, list) else value
                                            for name, value in self.to_wire().items()})
