"""The link in the cost model: a drafted round pays it unless its block was verified ahead; plain rounds
never do; a session that goes plain because of it says so."""

from __future__ import annotations

import dataclasses

from services.config import SpeculativeSettings
from services.speculative.block_length import BlockLengthController
from services.speculative.cost_model import CostModel, best_block_length

# the built-in pair on a 2-core AMX Xeon, native layout: ms per forward of n tokens, 20.4 ms a draft token
VERIFY = {1: 66.0, 2: 70.0, 3: 73.0, 4: 100.0, 5: 109.0, 6: 110.0, 7: 137.0, 8: 137.0, 9: 144.0}
COST = CostModel(VERIFY, draft_ms_per_token=20.4)


def test_a_drafted_round_pays_the_link_unless_verified_ahead_and_plain_rounds_never():
    linked = dataclasses.replace(COST, link_ms=50.0)
    assert linked.exposed_link_ms(0.9, 0) == 0.0  # target-only rounds run on the verify worker alone
    assert linked.exposed_link_ms(0.9, 4) == 50.0  # one block at a time: every round waits for the link
    ahead = dataclasses.replace(linked, blocks_ahead=4)
    assert abs(ahead.exposed_link_ms(0.9, 4) - 50.0 * (1 - 0.9 ** 5)) < 1e-9
    assert ahead.exposed_link_ms(0.9, 2) < ahead.exposed_link_ms(0.9, 6)  # short blocks hold their chain more
    assert linked.tokens_per_ms(0.9, 4) < COST.tokens_per_ms(0.9, 4)
    assert linked.tokens_per_ms(0.9, 0) == COST.tokens_per_ms(0.9, 0)


def test_blocks_ahead_that_do_not_cover_the_trip_and_the_drafting_leave_a_held_chain_waiting():
    """Two blocks out behind 50 ms: a block goes out when the verdict of the one before its parent is heard, so
    one comes every (50 link + 5 x 20.4 drafting + 109 verifying) / 2 = 130.5 ms, and a round that finds its
    block waiting takes 109 (its next block's drafting hides under it): 21.5 ms a held round waits."""
    shallow = dataclasses.replace(COST, link_ms=50.0, blocks_ahead=2)
    hit = 0.9 ** 5
    assert abs(shallow.exposed_link_ms(0.9, 4) - (50.0 * (1 - hit) + hit * 21.5)) < 1e-9
    deep = dataclasses.replace(shallow, blocks_ahead=3)  # (50 + 102 + 109) / 3 = 87 ms: covered
    assert abs(deep.exposed_link_ms(0.9, 4) - 50.0 * (1 - hit)) < 1e-9
    assert shallow.tokens_per_ms(0.9, 4) < deep.tokens_per_ms(0.9, 4)


def test_a_slow_enough_link_makes_plain_win_and_blocks_ahead_push_that_back():
    candidates = range(1, 9)
    assert best_block_length(0.9, COST, candidates)[0] > 0
    assert best_block_length(0.9, dataclasses.replace(COST, link_ms=400.0), candidates)[0] == 0
    ahead = dataclasses.replace(COST, link_ms=400.0, blocks_ahead=2)
    gamma, _ = best_block_length(0.97, ahead, candidates)
    assert gamma > 0  # a well-accepted draft holds its chain often enough to hide most of it


def test_a_session_that_goes_plain_for_its_link_says_so():
    config = SpeculativeSettings(fallback_min_rounds=2, prior_acceptance=0.9)
    slow = BlockLengthController(config, cost=dataclasses.replace(COST, link_ms=400.0), explore=False)
    assert slow.fallen_back and slow.fallback_reason == "link"
    costly = BlockLengthController(config, cost=CostModel(VERIFY, draft_ms_per_token=200.0), explore=False)
    assert costly.fallen_back and costly.fallback_reason == "cost"
    fine = BlockLengthController(config, cost=COST, explore=False)
    assert not fine.fallen_back and fine.fallback_reason is None
