"""Bridging's rule: a block's draft tokens against the tokens the target committed on its own meanwhile."""

from __future__ import annotations

import dataclasses

import pytest

from services.speculative.bridging import FastForward, bridge_lead, bridges, fast_forward
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


def test_greedy_and_unseeded_sessions_of_the_speculative_route_bridge_where_enabled():
    assert bridges(SamplingParams(), "sd")
    assert bridges(SamplingParams(temperature=0.8), "sd")
    assert not bridges(SamplingParams(temperature=0.8, seed=7), "sd")  # round r draws from its own stream
    assert bridges(SamplingParams(temperature=0.0, seed=7), "sd")  # greedy draws nothing
    assert not bridges(SamplingParams(), "sd", enabled=False)


def test_the_plain_route_always_bridges_seeded_too():
    """Each of its rounds is one token wherever its blocks fall, and its draft drafts nothing."""
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, seed=7)):
        assert bridges(sampling, "ar") and bridges(sampling, "ar", enabled=False)


def test_checked_draft_tokens_count_as_drafted_and_accepted_in_no_target_call():
    stats = SpecDecodingStats()
    stats.observe_checked(2, 2, ends_draft=False)
    stats.observe(3, 1)  # the round verifying the rest
    assert (stats.num_target_calls, stats.num_drafts) == (1, 1)
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (5, 3)
    stats.observe_checked(2, 1, ends_draft=True)  # a block answered at once
    assert (stats.num_target_calls, stats.num_drafts, stats.num_draft_tokens) == (1, 2, 7)
    assert stats.num_draft_tokens_per_pos == [3, 3, 1] and stats.num_accepted_tokens_per_pos == [3, 1, 0]


def _opened_session():
    """A draft session whose round 0 the gateway sent (its opening), answered with one token."""
    from services.config import SpeculativeSettings
    from services.engine.draft_session import DraftSession
    from services.protocol import SessionSpec, Verdict

    spec = SessionSpec(request_id="r", prompt_ids=[1, 2, 3], max_new_tokens=16, opened=True)
    session = DraftSession(spec, [], drafter=None, speculative=SpeculativeSettings(block_policy="acceptance"),
                           cost=None, reply_to="inbox", pipelined=True)
    assert session.in_opening
    session.on_verdict(Verdict(request_id="r", round=0, num_committed=4, num_draft_tokens=0, num_accepted=0,
                               committed_ids=[10], num_rounds=1, worker_id="v",
                               block_id=session.in_flight.block.block_id))
    return session


def _event(seq: int, token: int, finished: bool = False):
    from services.protocol import OutputEvent

    return OutputEvent(request_id="r", seq=seq, token_ids=[token], num_output_tokens=seq + 1, finished=finished,
                       stats=SpecDecodingStats(num_emitted_tokens=seq + 1))


def test_a_draft_catches_up_with_the_rounds_bridged_since_its_openings_verdict():
    session = _opened_session()
    assert session.catching_up and session.round == 1 and session.committed == [1, 2, 3, 10]
    # the stream read back newest first: round 0 (known), three bridged rounds, then the end (its verdict comes)
    events = [_event(4, 14, finished=True), _event(3, 13), _event(2, 12), _event(1, 11), _event(0, 10)]
    assert session.catch_up(events) == 3
    assert (session.round, session.committed, session.num_output) == (4, [1, 2, 3, 10, 11, 12, 13], 4)
    assert session.stats.num_emitted_tokens == 4 and not session.catching_up
    block = session.next_block()  # drafted from there: the verify worker finds its point on its bridge
    assert (block.round, block.num_committed) == (4, 7)


def test_a_draft_does_not_catch_up_over_a_gap_or_with_a_block_out():
    session = _opened_session()
    assert session.catch_up([_event(3, 13), _event(2, 12)]) == 0  # round 1 is older than what was read
    assert session.round == 1 and session.committed == [1, 2, 3, 10]
    session.sent(session.next_block(), b"", None)
    assert session.catch_up([_event(1, 11)]) == 0 and session.round == 1


def test_a_bridge_lead_covers_the_rounds_bridged_while_a_block_drafted_from_a_read_point_crosses():
    """By hand, the built-in pair on one box (a bridged step 54 ms, a draft token 19 ms, blocks of 2): over no link
    the round in progress and the drafting come to 3 rounds; behind 100 ms (118 ms measured both ways) to 6."""
    assert bridge_lead(3.0, 2, 19.0, 54.0) == 3  # (3 + 38 + 54) / 35 = 2.7
    assert bridge_lead(118.0, 2, 19.0, 54.0) == 6  # (118 + 38 + 54) / 35 = 6.0
    assert bridge_lead(0.0, 0, 10.0, 50.0) == 2  # the round in progress: 50 / 40
    assert bridge_lead(3.0, 2, 60.0, 54.0) == 0  # a draft slower than the bridge could never catch up


def test_the_first_block_after_a_catch_up_drafts_the_rounds_its_bridge_runs_meanwhile_and_the_next_does_not():
    """Measured at RTT 0 on one box: a first block of one token, drafted from the point its catch-up read, came when
    the bridge was 2 rounds past it, and was answered at once."""
    from services.config import SpeculativeSettings
    from services.engine.draft_session import DraftSession
    from services.models.drafters.ngram import NgramDrafter
    from services.protocol import SessionSpec, Verdict
    from services.speculative.cost_model import CostModel

    cost = CostModel({1: 54.0, 3: 57.0, 9: 115.0}, draft_ms_per_token=19.0, link_ms=3.0, blocks_ahead=2)
    spec = SessionSpec(request_id="r", prompt_ids=[1, 2, 3] * 4, max_new_tokens=64, opened=True)
    session = DraftSession(spec, [], drafter=NgramDrafter(), speculative=SpeculativeSettings(prior_acceptance=0.9),
                           cost=cost, reply_to="inbox", pipelined=True)
    session.on_verdict(Verdict(request_id="r", round=0, num_committed=13, num_draft_tokens=0, num_accepted=0,
                               committed_ids=[1], num_rounds=1, worker_id="v",
                               block_id=session.in_flight.block.block_id))
    gamma = session.controller.num_draft_tokens
    assert gamma > 0 and session.draft_call().num_draft_tokens == gamma  # no catch-up read yet: no lead
    assert session.catch_up([_event(1, 2), _event(0, 1)]) == 1
    lead = bridge_lead(3.0, gamma, 19.0, 54.0)
    assert session.draft_call().num_draft_tokens == gamma + lead
    block = session.next_block()  # the ngram drafter proposed nothing: one target-only round, and the lead is spent
    session.sent(block, b"", None)
    session.on_verdict(Verdict(request_id="r", round=2, num_committed=15, num_draft_tokens=0, num_accepted=0,
                               committed_ids=[3], num_rounds=1, worker_id="v", block_id=block.block_id))
    assert session.draft_call().num_draft_tokens == gamma
    # sixteen sessions on its draft worker: a batched draft step (144 ms) dearer than a bridged round of the 16-row
    # step (121 ms, the profile of this box): no lead
    loaded = DraftSession(spec, [], drafter=NgramDrafter(), speculative=SpeculativeSettings(prior_acceptance=0.99),
                          cost=dataclasses.replace(cost, draft_step_ms={16: 144.0}, step_ms={16: {1: 121.0, 3: 170.0}}),
                          reply_to="inbox", pipelined=True, draft_sessions=16)
    loaded.on_verdict(Verdict(request_id="r", round=0, num_committed=13, num_draft_tokens=0, num_accepted=0,
                              committed_ids=[1], num_rounds=1, worker_id="v", block_id=loaded.in_flight.block.block_id),
                      draft_sessions=16)
    loaded.catch_up([_event(1, 2), _event(0, 1)])
    assert loaded._lead == 0
