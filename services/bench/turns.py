"""Link levels taken in turns (`mirror-sd bench --draft-link 0,20 --link-turns 3`): pure figures.

A box's speed drifts over minutes, so two levels run one after the other differ by the drift as well as by the
link. Taken in turns (0, 20, 0, 20, ...), the levels share the drift: a level's figure over the first level's
in the same turn is the link's own effect, and the median over turns keeps one odd turn from deciding it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

SEPARATOR = " / "  # joins a non-numeric figure's turns (e.g. a capacity ">= 16")


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def median_headline(turns: Sequence[dict]) -> dict:
    """One level's figures over its turns: the median of each numeric figure (None where no turn has it); any
    other figure as its turns wrote it, joined when they differ."""
    merged: dict = {}
    for key in dict.fromkeys(key for turn in turns for key in turn):
        values = [turn.get(key) for turn in turns if turn.get(key) is not None]
        if values and all(_number(value) for value in values):
            merged[key] = statistics.median(values)
        elif values:
            texts = list(dict.fromkeys(str(value) for value in values))
            merged[key] = texts[0] if len(texts) == 1 else SEPARATOR.join(str(value) for value in values)
        else:
            merged[key] = None
    return merged


def turn_ratios(first: Sequence[dict], level: Sequence[dict], key: str) -> list[float | None]:
    """A level's `key` over the first level's, turn by turn (None where either lacks it or the first is 0)."""
    ratios: list[float | None] = []
    for base, here in zip(first, level):
        a, b = base.get(key), here.get(key)
        ratios.append(b / a if _number(a) and _number(b) and a else None)
    return ratios


def median_of(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def rate_keys(turns_by_level: Sequence[Sequence[dict]]) -> list[str]:
    """The figures a turn-by-turn table compares: the rates (tok/s), as the levels name them."""
    keys = (key for turns in turns_by_level for turn in turns for key in turn)
    return [key for key in dict.fromkeys(keys) if key.endswith("tok/s")]


def turns_markdown(labels: Sequence[str], turns_by_level: Sequence[Sequence[dict]]) -> str:
    """For each rate, each level over the first level in the same turn, and the median of those ratios."""
    if len(labels) < 2 or not turns_by_level or len(turns_by_level[0]) < 2:
        return ""
    count = len(turns_by_level[0])
    lines = [f"\nTurn by turn (the levels taken in turn, {count} times): each level's figure over the first "
             f"level's ({labels[0]}) in the same turn, and the median of those ratios.\n"]
    for key in rate_keys(turns_by_level):
        lines += [f"| {key}: draft link | " + " | ".join(f"turn {index + 1}" for index in range(count))
                  + " | median |", "|" + "---|" * (count + 2)]
        for label, turns in zip(labels[1:], turns_by_level[1:]):
            ratios = turn_ratios(turns_by_level[0], turns, key)
            cells = ["–" if ratio is None else f"{ratio:.3f}" for ratio in [*ratios, median_of(ratios)]]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)
