"""Bridging's rule: a block's draft tokens against the tokens the target committed on its own meanwhile."""

from __future__ import annotations

import pytest

from services.speculative.bridging import FastForward, bridges, fast_forward
from services.speculative.params import SamplingParams
from services.speculative.stats import SpecDecodingStats


@pytest.mark.parametrize("draft_ids, bridged_ids, expected", [
    ([1, 2, 3, 4], [], FastForward(0, 0, 4)),  # nothing bridged: verified whole, as usual
    ([1, 2, 3, 4], [1, 2], FastForward(2, 2, 2)),  # the first two were committed meanwhile: the rest verified
    ([1, 2, 3, 4], [1, 9], FastForward(2, 1, 0)),  # rejected at the second: answered at once
    ([1, 2, 3, 4], [9], FastForward(1, 0, 0)),
    ([1, 2, 3, 4], [1, 2, 3, 4], FastForward(4, 4, 0)),  # all matched, nothing left: answered at once
    ([1, 2], [1, 2, 5, 6], FastForward(2, 2, 0)),  # the bridge went past the block
    ([1, 2], [1, 7, 5, 6], FastForward(2, 1, 0)),
    ([], [4, 5], FastForward(0, 0, 0)),
])
def test_fast_forward(draft_ids, bridged_ids, expected):
    assert fast_forward(draft_ids, bridged_ids) == expected


def test_greedy_and_unseeded_sessions_of_the_speculative_route_bridge():
    assert bridges(SamplingParams(), "sd")
    assert bridges(SamplingParams(temperature=0.8), "sd")
    assert not bridges(SamplingParams(temperature=0.8, seed=7), "sd")  # round r draws from its own stream
    assert bridges(SamplingParams(temperature=0.0, seed=7), "sd")  # greedy draws nothing
    assert not bridges(SamplingParams(), "ar")


def test_checked_draft_tokens_count_as_drafted_and_accepted_in_no_target_call():
    stats = SpecDecodingStats()
    stats.observe_checked(2, 2, ends_draft=False)
    stats.observe(3, 1)  # the round verifying the rest
    assert (stats.num_target_calls, stats.num_drafts) == (1, 1)
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (5, 3)
    stats.observe_checked(2, 1, ends_draft=True)  # a block answered at once
    assert (stats.num_target_calls, stats.num_drafts, stats.num_draft_tokens) == (1, 2, 7)
    assert stats.num_draft_tokens_per_pos == [3, 3, 1] and stats.num_accepted_tokens_per_pos == [3, 1, 0]
