import pytest

from services.speculative.stats import SpecDecodingStats


def test_counters_and_formulas():
    stats = SpecDecodingStats()
    stats.observe(4, 4)  # 5 tokens
    stats.observe(4, 1)  # 2 tokens
    stats.observe(2, 0)  # 1 token
    stats.observe(0, 0)  # target-only round: 1 token
    assert stats.num_target_calls == 4
    assert stats.num_drafts == 3
    assert stats.num_draft_tokens == 10
    assert stats.num_accepted_tokens == 5
    assert stats.num_emitted_tokens == 9
    assert stats.num_draft_tokens_per_pos == [3, 3, 2, 2]
    assert stats.num_accepted_tokens_per_pos == [2, 1, 1, 1]
    assert stats.acceptance_rate == pytest.approx(0.5)
    assert stats.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert stats.tokens_per_target_call == pytest.approx(9 / 4)
    assert stats.acceptance_rate_per_pos == pytest.approx([2 / 3, 1 / 3, 0.5, 0.5])


def test_merge_adds_up():
    left, right, both = SpecDecodingStats(), SpecDecodingStats(), SpecDecodingStats()
    for stats, rounds in ((left, [(2, 1)]), (right, [(5, 5), (0, 0)])):
        for drafted, accepted in rounds:
            stats.observe(drafted, accepted)
            both.observe(drafted, accepted)
    left.merge(right)
    assert left.to_dict() == both.to_dict()


def test_empty_stats_do_not_divide_by_zero():
    stats = SpecDecodingStats()
    assert stats.acceptance_rate == 0.0
    assert stats.mean_acceptance_length == 1.0


def test_a_sql_row_keeps_the_counters_and_the_rates_come_back_from_them():
    from types import SimpleNamespace

    stats = SpecDecodingStats()
    for drafted, accepted in [(4, 3), (4, 4), (2, 0)]:
        stats.observe(drafted, accepted)
    row = SimpleNamespace(**stats.row_counters())
    assert stats.row_counters() == {"num_drafts": 3, "num_draft_tokens": 10, "num_accepted_tokens": 7}
    again = SpecDecodingStats.from_row_counters(row)
    assert again.acceptance_rate == stats.acceptance_rate == 0.7
    assert again.mean_acceptance_length == stats.mean_acceptance_length == 1 + 7 / 3
    empty = SpecDecodingStats.from_row_counters(SimpleNamespace(num_drafts=None, num_draft_tokens=0,
                                                                num_accepted_tokens=0))
    assert empty.acceptance_rate == 0.0 and empty.mean_acceptance_length == 1.0
