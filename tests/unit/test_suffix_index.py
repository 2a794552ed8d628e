"""The suffix index: longest earlier match, frequency-weighted continuations, documents, eviction, rollback."""

from __future__ import annotations

import random

import pytest

from services.models.drafters.suffix_index import SuffixIndex, memory_bytes


def test_the_continuation_of_the_longest_match_is_proposed():
    index = SuffixIndex(64)
    index.add_document([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    draft = index.speculate([7, 2, 3, 4], 8, max_spec_factor=1.0, max_spec_offset=1.0)
    assert draft.token_ids == [5, 6, 7, 8]  # 3 matched tokens: at most 3 * 1 + 1 proposed
    assert draft.match_length == 3
    assert draft.cumulative_probs == [1.0] * 4
    assert index.speculate([2, 3, 4, 5, 6, 7, 8], 8).token_ids == [9, 10]  # the document ends there


def test_a_longer_match_wins_over_a_more_recent_shorter_one():
    index = SuffixIndex(256)
    index.add_document([11, 12, 13, 14, 15, 1, 2, 50, 51])
    index.add_document([30, 31, 1, 2, 60, 61])  # more recent, but only "1 2" matches
    draft = index.speculate([13, 14, 15, 1, 2], 2, max_spec_factor=1.0)
    assert draft.token_ids == [50, 51] and draft.match_length == 5


def test_frequencies_give_the_most_common_next_token_and_its_chance():
    index = SuffixIndex(256)
    for follow in (7, 7, 7, 9):
        index.add_document([1, 2, 3, 4, follow, 5])
    draft = index.speculate([1, 2, 3, 4], 4)
    assert draft.token_ids[0] == 7
    assert draft.cumulative_probs[0] == pytest.approx(0.75)
    assert draft.score == pytest.approx(sum(draft.cumulative_probs))
    # a chance below min_prob stops the draft
    assert index.speculate([1, 2, 3, 4], 4, min_prob=0.8).token_ids == []


def test_the_draft_is_no_longer_than_the_match_allows():
    index = SuffixIndex(256)
    index.add_document(list(range(100, 140)))
    assert len(index.speculate([105, 106], 30, max_spec_factor=1.0, max_spec_offset=0.0).token_ids) == 2
    assert len(index.speculate([100, 101, 102, 103, 104, 105, 106], 30, max_spec_factor=2.0,
                               max_spec_offset=0.0).token_ids) == 14


def test_no_match_and_no_continuation_propose_nothing():
    index = SuffixIndex(64)
    index.add_document([1, 2, 3])
    assert index.speculate([8, 9], 4).token_ids == []
    assert index.speculate([1, 2, 3], 4).token_ids == []  # its only occurrence ends the document
    assert index.speculate([], 4).token_ids == []
    assert index.speculate([1, 2], 0).token_ids == []


def test_memory_is_fixed_and_old_text_is_evicted_under_a_flood():
    index = SuffixIndex(1000)
    before = index.memory_bytes
    assert before == memory_bytes(1000, (8, 4, 2), 1024)
    rng = random.Random(0)
    index.add_document([7001, 7002, 7003, 7004, 7005])
    for _ in range(200):
        index.add_document([rng.randrange(5000) for _ in range(50)])
    assert index.memory_bytes == before
    assert index.num_tokens == 1000
    assert index.speculate([7001, 7002, 7003], 4).token_ids == []  # overwritten long ago
    recent = [rng.randrange(5000) for _ in range(30)]
    index.add_document([9001, 9002, 9003, *recent])
    assert index.speculate([9001, 9002, 9003], 4, max_spec_factor=2.0).token_ids == recent[:4]


def test_a_tiny_chain_table_collides_but_never_proposes_a_wrong_match():
    rng = random.Random(1)
    small = SuffixIndex(4096, table_size=1024)  # 3000 positions over 1024 slots: chains share slots
    text = [rng.randrange(50) for _ in range(3000)]
    small.extend(text)
    proposed = 0
    for start in range(0, 2900, 97):
        context = text[start:start + 12]
        draft = small.speculate(context, 6)
        if not draft.token_ids:
            continue
        proposed += 1
        tail = context[-draft.match_length:]
        # what it proposes followed an occurrence of the context's last match_length tokens
        assert any(text[i:i + len(tail)] == tail and text[i + len(tail)] == draft.token_ids[0]
                   for i in range(len(text) - len(tail)))
    assert proposed > 10


def test_truncate_forgets_a_rejected_tail_exactly():
    index = SuffixIndex(64)
    index.extend([1, 2, 3, 4, 5, 1, 2, 3])
    assert index.speculate([1, 2, 3], 4, max_spec_factor=2.0).token_ids == [4, 5, 1, 2]
    index.truncate(5)  # [1, 2, 3, 4, 5]: the second "1 2 3" was a draft the target rejected
    index.extend([1, 2, 9])
    fresh = SuffixIndex(64)
    fresh.extend([1, 2, 3, 4, 5, 1, 2, 9])
    for context in ([1, 2], [4, 5], [5, 1, 2], [2, 3, 4]):
        assert index.speculate(context, 4) == fresh.speculate(context, 4)


def test_bad_dimensions_are_refused():
    with pytest.raises(ValueError, match="capacity"):
        SuffixIndex(1)
    with pytest.raises(ValueError, match="key lengths"):
        SuffixIndex(64, key_lengths=(0,))
