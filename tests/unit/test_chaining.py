"""The rule for blocks verified ahead, as both sides apply it, and how many blocks to keep ahead."""

from __future__ import annotations

import dataclasses

import pytest

from services.protocol import DraftBlock, Verdict
from services.speculative.chaining import MAX_BLOCKS_AHEAD, blocks_ahead, chain_holds, followed

PARENT = DraftBlock(request_id="r", round=3, num_committed=20, draft_ids=[7, 8, 9], block_id=5)
CHILD = DraftBlock(request_id="r", round=4, num_committed=24, draft_ids=[1, 2], block_id=6, parent_id=5,
                   assumed_bonus=42)
WHOLE = Verdict(request_id="r", round=3, num_committed=24, num_draft_tokens=3, num_accepted=3,
                committed_ids=[7, 8, 9, 42], worker_id="v", block_id=5)


def test_a_parent_accepted_whole_with_the_guessed_bonus_holds_the_chain():
    assert chain_holds(WHOLE, PARENT, CHILD)


@pytest.mark.parametrize("change", [
    {"num_accepted": 2, "committed_ids": [7, 8, 11], "num_committed": 23},  # a rejection in the parent
    {"committed_ids": [7, 8, 9, 43]},  # accepted whole, another bonus
    {"finished": True},  # the request ended there
    {"worker_id": ""},  # a resync from the stream, not a verification
    {"block_id": 4},  # the verdict of another block of that round
    {"num_rounds": 2, "committed_ids": [7, 8, 9, 42, 3], "num_committed": 25},  # a target-only round followed
])
def test_any_other_verdict_breaks_it(change):
    assert not chain_holds(dataclasses.replace(WHOLE, **change), PARENT, CHILD)


def test_a_block_that_is_not_the_childs_parent_breaks_it():
    assert not chain_holds(WHOLE, dataclasses.replace(PARENT, block_id=9), CHILD)
    assert not chain_holds(WHOLE, PARENT, dataclasses.replace(CHILD, parent_id=0))
    assert not chain_holds(WHOLE, dataclasses.replace(PARENT, num_rounds=2), CHILD)


def test_rounds_bridged_before_the_parent_came_keep_the_chain_and_renumber_the_child():
    """The verify worker ran 2 target-only rounds (tokens 7 and 8) while the parent was on its way: the
    verdict covers 3 rounds, the same tokens; the child becomes the round after them, on both sides."""
    bridged = dataclasses.replace(WHOLE, num_rounds=3, num_bridged=2)
    assert chain_holds(bridged, PARENT, CHILD)
    assert followed(CHILD, bridged).round == 6 and followed(CHILD, bridged).block_id == CHILD.block_id
    assert followed(CHILD, WHOLE) is CHILD


def test_blocks_ahead_cover_the_link_per_verify_time():
    assert blocks_ahead(1, 50.0, 10.0) == 1  # set: one at a time
    assert blocks_ahead(3, None, None) == 3
    assert blocks_ahead(0, None, None) == 2  # nothing measured yet
    assert blocks_ahead(0, 0.3, 40.0) == 2  # a local Redis: the second costs no extra drafting
    assert blocks_ahead(0, 20.0, 40.0) == 2
    assert blocks_ahead(0, 50.0, 40.0) == 3
    assert blocks_ahead(0, 100.0, 40.0) == 4
    assert blocks_ahead(0, 1000.0, 40.0) == MAX_BLOCKS_AHEAD
    # the drafting of a block counts too: a block goes out after the verdict depth blocks back is heard
    assert blocks_ahead(0, 20.0, 40.0, drafting_ms=25.0) == 3
    assert blocks_ahead(0, 100.0, 60.0) == 3 and blocks_ahead(0, 100.0, 60.0, drafting_ms=40.0) == 4
