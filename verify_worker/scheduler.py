"""Which sessions' rows go into the next target step: a pure choice over what each session needs.

Continuous batching with a token budget (vLLM's max_num_batched_tokens):
running streams (a row that verifies a block or decodes one token) are cheap
and go first, so they never wait behind a prompt; a prompt being prefilled
takes what is left of the budget this step and the rest in later steps.
Priority (0 high .. 2 low) orders both groups; arrival breaks ties.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Candidate:
    key: str
    priority: int
    pending_tokens: int  # tokens this session must feed to verify its block (uncached + last + draft)
    running: bool  # only the last committed token is uncached: its whole round is one small row
    arrived: float  # when its block came


@dataclass(frozen=True)
class PlannedRow:
    key: str
    token_budget: int | None  # None: the whole round in one row; else a prefill chunk of at most this


def plan_step(candidates: Iterable[Candidate], *, max_rows: int, max_tokens: int) -> list[PlannedRow]:
    """Rows for one step: at most max_rows, about max_tokens tokens (a running row is never split, and the
    first row always goes in, so an oversized block still makes progress)."""
    ordered = sorted(candidates, key=lambda c: (not c.running, c.priority, c.arrived))
    planned: list[PlannedRow] = []
    tokens = 0
    for candidate in ordered:
        if len(planned) == max_rows:
            break
        room = max_tokens - tokens
        if candidate.running:
            if candidate.pending_tokens > room and planned:
                continue
            planned.append(PlannedRow(candidate.key, None))
            tokens += candidate.pending_tokens
        elif room > 0 or not planned:
            budget = max(room, 1) if planned else max_tokens
            planned.append(PlannedRow(candidate.key, budget))
            tokens += min(budget, candidate.pending_tokens)
    return planned
