"""Branches: blocks sent ahead for a block's likeliest rejections, not only for its acceptance whole.

A chained block (services/speculative/chaining.py) holds only when its
parent is accepted whole and the draft guessed the bonus token: with about
0.9 acceptance per token and 5-token blocks, about half the time. Every
other verdict sends the verify worker waiting a trip over the link (the
verdict to the draft, the next block back), decoding one token a step
meanwhile. A branch covers one of those verdicts: drafted while its parent
is verified, from the parent's first k draft tokens followed by the draft's
second choice at position k (its guess of the token the target puts there
instead), it holds when the target rejects exactly there with exactly that
token. The verify worker then goes on with it at once, as with a chained
block, and the chain continues from the branch.

Which positions: the draft's own probabilities rank them. The chance that
the target's greedy path runs through the branch at k is about
p1(0) * ... * p1(k-1) * p2(k): the draft's top probabilities up to k, and
its second choice's at k (position len(parent) is the bonus token's, where
the chained block took the first choice). The likeliest positions are
branched, as many as the setting allows, while their chance is worth a
branch's drafting.

A branch is an ordinary draft of the context it assumes, checked token for
token (chain_holds), so output is unchanged. Greedy sessions only: a
sampled session's replacement token is a draw the draft cannot guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    """The draft's two likeliest tokens at one position, with their probabilities."""

    first: int
    first_p: float
    second: int
    second_p: float


@dataclass(frozen=True)
class BranchPoint:
    accepted: int  # the parent's draft tokens assumed accepted before it
    token: int  # the token assumed in place of the draft's first choice there
    chance: float  # the draft's estimate that the target's path runs through it


def branch_points(start: int, path: Sequence[int], choices: Mapping[int, Choice], max_branches: int,
                  min_chance: float) -> list[BranchPoint]:
    """Where to branch a block: `path` is its draft tokens followed by the guessed bonus token (the chained
    block's assumption), at context positions start, start + 1, ...; `choices` the draft's two likeliest
    tokens per position, where it has them. The likeliest max_branches points with chance >= min_chance,
    likeliest first. A position whose choices are unknown, or whose first choice is not the path's token (a
    prompt-lookup token), ends the ranking there: what follows it is not the draft's to estimate."""
    points, reach = [], 1.0
    for offset, token in enumerate(path):
        choice = choices.get(start + offset)
        if choice is None or choice.first != token:
            break
        chance = reach * choice.second_p
        if chance >= min_chance and choice.second != token:
            points.append(BranchPoint(offset, choice.second, chance))
        reach *= choice.first_p
    points.sort(key=lambda point: -point.chance)
    return points[:max_branches]
