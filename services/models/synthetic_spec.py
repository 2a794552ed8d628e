"""What a synthetic draft is (`synthetic:<acceptance>[@<ms>ms]`) and what it drafts from: the target's greedy
output per prompt (a reference book), and whether a position is right (a pure function of seed, prompt and
position). Plain Python: `up`, `status`, the gateway and the bench read these without loading torch; the drafter
itself is services/models/drafters/synthetic.py."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


SYNTHETIC_PREFIX = "synthetic:"
MAX_MS_PER_TOKEN = 10_000.0


@dataclass(frozen=True)
class SyntheticSpec:
    acceptance: float  # per position: P(the proposed token is the target's greedy token)
    ms_per_token: float = 0.0  # slept per proposed token

    @property
    def name(self) -> str:
        return f"{SYNTHETIC_PREFIX}{self.acceptance:g}" + (f"@{self.ms_per_token:g}ms" if self.ms_per_token else "")


def is_synthetic_spec(spec: str) -> bool:
    return spec.startswith(SYNTHETIC_PREFIX)


def parse_synthetic_spec(spec: str) -> SyntheticSpec:
    """`synthetic:0.7` -> (0.7, 0 ms); `synthetic:0.9@8ms` -> (0.9, 8 ms). A bad value is named."""
    text = spec[len(SYNTHETIC_PREFIX):]
    acceptance_text, at, cost_text = text.partition("@")
    try:
        acceptance = float(acceptance_text)
    except ValueError:
        raise ValueError(f"draft {spec!r}: acceptance {acceptance_text!r} is not a number "
                         "(use e.g. synthetic:0.9 or synthetic:0.9@8ms)") from None
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"draft {spec!r}: acceptance {acceptance_text!r} is outside [0, 1]")
    if not at:
        return SyntheticSpec(acceptance)
    number = cost_text.removesuffix("ms")
    try:
        if number == cost_text:
            raise ValueError
        ms_per_token = float(number)
    except ValueError:
        raise ValueError(f"draft {spec!r}: cost {cost_text!r} must be milliseconds per draft token, "
                         "e.g. @8ms or @0.5ms") from None
    if not 0.0 <= ms_per_token <= MAX_MS_PER_TOKEN:
        raise ValueError(f"draft {spec!r}: cost {cost_text!r} is outside 0..{MAX_MS_PER_TOKEN:g} ms per token")
    return SyntheticSpec(acceptance, ms_per_token)


class ReferenceBook:
    """Reference sequences (prompt + the target's greedy output), found by the prompt they start with.
    fetch: where more come from on a miss (a stack's drafts: Redis), None for the bench's in-process book."""

    def __init__(self, fetch: Callable[[], Iterable[tuple[Sequence[int], Sequence[int]]]] | None = None) -> None:
        self._by_prompt: dict[tuple[int, ...], list[int]] = {}
        self.fetch = fetch

    def add(self, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> None:
        self._by_prompt[tuple(prompt_ids)] = [*prompt_ids, *output_ids]

    def _find_here(self, context_ids: Sequence[int]) -> tuple[tuple[int, ...], list[int]] | None:
        """The reference whose prompt starts the context and that goes on past it, the longest prompt first: a
        conversation's turn 2 starts with turn 1's prompt, but only its own reference knows what comes next."""
        found = None
        for prompt, reference in self._by_prompt.items():
            if len(prompt) <= len(context_ids) < len(reference) and tuple(context_ids[: len(prompt)]) == prompt:
                if found is None or len(prompt) > len(found[0]):
                    found = prompt, reference
        return found

    def find_with_prompt(self, context_ids: Sequence[int]) -> tuple[tuple[int, ...], list[int]] | None:
        """(the reference's prompt, the reference), or None when no reference run starts the context."""
        found = self._find_here(context_ids)
        if found is None and self.fetch is not None:
            for prompt_ids, output_ids in self.fetch():
                self.add(prompt_ids, output_ids)
            found = self._find_here(context_ids)
        return found

    def find(self, context_ids: Sequence[int]) -> list[int] | None:
        found = self.find_with_prompt(context_ids)
        return None if found is None else found[1]

    def __len__(self) -> int:
        return len(self._by_prompt)


def is_right(seed: int, prompt_digest: str, position: int, acceptance: float) -> bool:
    """Whether the draft proposes the target's token at this position: the same answer however often asked."""
    return random.Random(f"{seed}:{prompt_digest}:{position}").random() < acceptance


def prompt_digest(prompt_ids: Sequence[int]) -> str:
    return hashlib.blake2b(",".join(map(str, prompt_ids)).encode(), digest_size=8).hexdigest()
