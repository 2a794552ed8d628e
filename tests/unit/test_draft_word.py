"""The remote draft's last word on the load (verify_worker/draft_word.py)."""

from services.protocol import DraftBlock
from verify_worker.draft_word import DraftWord


def block(round_index: int, draft_ids=(), **fields) -> DraftBlock:
    return DraftBlock(request_id="r", round=round_index, num_committed=10 + round_index, draft_ids=list(draft_ids),
                      **fields)


def test_target_only_rounds_after_the_opening_say_plain_at_that_load_and_up():
    word = DraftWord()
    assert not word.goes_plain(16)  # nothing heard: a waiting session's draft may be drafting
    word.heard(block(3, num_rounds=64), sessions=8)
    assert word.plain_at == 8
    assert word.goes_plain(8) and word.goes_plain(32)
    assert not word.goes_plain(7)  # less load than then: it may draft again


def test_a_drafted_block_says_it_drafts_and_an_opening_or_a_release_says_nothing():
    word = DraftWord()
    word.heard(block(3, num_rounds=64), sessions=8)
    word.heard(block(0), sessions=9)  # an opening: target-only whatever the load
    word.heard(block(5, release=True), sessions=9)
    assert word.plain_at == 8
    word.heard(block(4, [1, 2, 3]), sessions=12)
    assert word.plain_at is None and not word.goes_plain(100)
