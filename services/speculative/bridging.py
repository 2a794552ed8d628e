"""Bridging: the verify worker decodes target-only while a session's next block is on its way.

Between a verdict and the next block the verify worker would idle for a trip
over the draft link plus the drafting of that block. Instead it runs
target-only rounds of one token each for the session (plain decoding, the
very tokens target-only decoding commits) and streams them. When the block
arrives, drafted from the verdict's point, its first tokens are checked
against the tokens bridged meanwhile:

- they all match and some draft tokens are left: the rest is verified as
  usual, from where the bridge got to (the block "fast-forwards");
- a token differs, or the bridge went past the whole block: the block is
  answered at once with a verdict of everything committed since its point,
  and the bridge goes on.

Greedy output stays identical to target-only (every committed token is the
target's own choice or a draft token checked against it). Sampled output
keeps its distribution: the bridged tokens are the target's own samples and
the rest of the block is drafted on exactly that prefix. Seeded sampling
does not bridge on the speculative route: round r draws from its own stream,
and where the rounds fall would depend on timing.

The plain route (`"route": "ar"`) always bridges. Its blocks are target-only
rounds (up to 64) that a draft worker sends after each verdict, so without a
bridge every block would wait a trip over the draft link, and the first one
the task's start too. Its draft drafts nothing, so decoding on takes no core
from it. Every round is one token wherever the blocks fall, so seeded
sampling draws the same tokens too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from services.speculative.params import SamplingParams


@dataclass(frozen=True)
class FastForward:
    num_checked: int  # draft tokens compared with bridged tokens
    num_matched: int  # of those, how many from the start agreed
    rest: int  # draft tokens still to verify (0: the block is answered at once)


def fast_forward(draft_ids: Sequence[int], bridged_ids: Sequence[int]) -> FastForward:
    """A block's draft tokens against the tokens the target committed on its own since the block's point."""
    matched = 0
    for draft_id, bridged_id in zip(draft_ids, bridged_ids):
        if draft_id != bridged_id:
            break
        matched += 1
    if matched == len(bridged_ids) and matched < len(draft_ids):
        return FastForward(matched, matched, len(draft_ids) - matched)
    checked = min(len(draft_ids), matched + 1, len(bridged_ids))
    return FastForward(checked, matched, 0)


def bridge_lead(link_ms: float, gamma: int, draft_ms: float, bridge_ms: float) -> int:
    """Rounds a bridge runs on past the point a block is drafted from, when the draft read that point from the
    stream just now (its catch-up after prefilling): the round in progress, and one a bridged step while the
    read's answer crosses back, the block of gamma + lead tokens is drafted and crosses there (the link, both
    ways). Drafting those rounds too lets the block go on from the bridge instead of falling behind it (answered
    at once, and drafted again a whole trip later). 0 where a draft token costs a bridged step or more: no block
    could catch up."""
    if draft_ms >= bridge_ms:
        return 0
    return math.ceil((max(0.0, link_ms) + gamma * draft_ms + bridge_ms) / (bridge_ms - draft_ms))


def bridges(sampling: SamplingParams, route: str, *, enabled: bool = True) -> bool:
    """Whether a session drafted remotely may bridge: always on the plain route, and on the speculative route
    where `enabled` (scheduler.bridge) for greedy or unseeded sampling."""
    if route == "ar":
        return True
    return enabled and route == "sd" and sampling.layout_free
