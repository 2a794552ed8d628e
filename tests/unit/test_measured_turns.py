"""MeasuredTurns: drafting or plain turns by what turns at the same load measured."""

import pytest

from services.speculative.measured_turns import DRAFT, PLAIN, DraftPrefillCost, MeasuredTurns, load_bucket


def test_loads_share_buckets_of_powers_of_two_and_their_halfway_points():
    loads = (0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 16, 23, 24, 32, 47, 48)
    assert [load_bucket(n) for n in loads] == [1, 1, 2, 3, 4, 4, 6, 6, 8, 8, 12, 16, 16, 24, 32, 32, 48]


def test_the_predicted_arm_goes_first_then_the_other_is_tried():
    turns = MeasuredTurns(min_turns=2, explore_every=100)
    picks = []
    for _ in range(4):
        arm = turns.choose(8, predicted=DRAFT)
        picks.append(arm)
        turns.record(8, arm, tokens=10, seconds=1.0)
    assert picks == [DRAFT, DRAFT, PLAIN, PLAIN]


def test_the_faster_arm_wins_and_trials_of_the_slower_come_ever_rarer():
    turns = MeasuredTurns(min_turns=2, explore_every=5, max_explore_every=20)
    rates = {DRAFT: 40.0, PLAIN: 70.0}  # drafting predicted, plain measured faster (a 2-core box at 8 streams)
    picks = []
    for _ in range(100):
        arm = turns.choose(8, predicted=DRAFT)
        picks.append(arm)
        turns.record(8, arm, tokens=int(rates[arm]), seconds=1.0)
    trials = [index for index, arm in enumerate(picks[4:]) if arm == DRAFT]
    assert trials[0] == 4  # the 5th decided turn
    assert [b - a for a, b in zip(trials, trials[1:])] == [10, 20, 20, 20, 20]  # each confirmation doubles, to 20
    assert turns.to_dict() == {"8": {"draft": 40.0, "plain": 70.0}}


def test_a_change_of_speed_turns_the_choice_around():
    turns = MeasuredTurns(min_turns=1, explore_every=2, max_explore_every=4, decay=0.5)
    rates = {DRAFT: 30.0, PLAIN: 60.0}
    for _ in range(10):
        arm = turns.choose(1, predicted=PLAIN)
        turns.record(1, arm, tokens=int(rates[arm]), seconds=1.0)
    assert turns.choose(1, predicted=PLAIN) in (PLAIN, DRAFT)
    rates[DRAFT] = 120.0  # e.g. the acceptance rose: the exploring turns see it
    for _ in range(10):
        arm = turns.choose(1, predicted=PLAIN)
        turns.record(1, arm, tokens=int(rates[arm]), seconds=1.0)
    assert turns.figures(1, DRAFT).rate > turns.figures(1, PLAIN).rate
    picks = [turns.choose(1, predicted=PLAIN) for _ in range(4)]
    assert picks.count(DRAFT) >= 2


def test_buckets_are_measured_apart_and_empty_turns_count_nothing():
    turns = MeasuredTurns(min_turns=1)
    turns.record(1, DRAFT, tokens=50, seconds=1.0)
    turns.record(16, PLAIN, tokens=90, seconds=1.0)
    turns.record(16, DRAFT, tokens=5, seconds=0.0)  # no time: nothing learned
    assert turns.to_dict() == {"1": {"draft": 50.0}, "16": {"plain": 90.0}}


def test_drafting_is_charged_its_prompt_prefill_per_output_token():
    """DraftPrefillCost: the draft's prefill rate times the prompt tokens it read per output token; the choice
    adds it to drafting's figure (40 tok/s drafting against 30 plain, but 10 ms of prefill per token: 28.6)."""
    cost = DraftPrefillCost(decay=1.0)
    assert cost.per_output_token_s == 0.0  # nothing seen yet: nothing charged
    cost.prefilled(tokens=100, seconds=0.25)  # 2.5 ms a token
    cost.finished(prompt_tokens=200, output_tokens=50)  # 4 prompt tokens per output token
    assert cost.per_output_token_s == pytest.approx(0.01)
    turns = MeasuredTurns(min_turns=1, explore_every=100)
    turns.record(1, DRAFT, tokens=40, seconds=1.0)
    turns.record(1, PLAIN, tokens=30, seconds=1.0)
    assert turns.rate(1, DRAFT, cost.per_output_token_s) == pytest.approx(1 / (1 / 40 + 0.01))
    assert turns.choose(1, predicted=DRAFT) == DRAFT
    assert turns.choose(1, predicted=DRAFT, draft_cost_s=cost.per_output_token_s) == PLAIN


def test_a_heavier_load_decodes_plain_without_trying_drafting_where_a_lighter_one_decoded_plain():
    turns = MeasuredTurns(min_turns=1, explore_every=100)
    assert turns.choose(8, predicted=DRAFT) == DRAFT  # nothing measured below: the prediction goes first
    turns.record(2, DRAFT, tokens=10, seconds=1.0)
    turns.record(2, PLAIN, tokens=20, seconds=1.0)
    assert turns.choose(8, predicted=DRAFT) == PLAIN
    assert turns.choose(1, predicted=DRAFT) == DRAFT  # a lighter load still explores
    turns.record(2, DRAFT, tokens=200, seconds=1.0)  # a trial at 2 turned the choice around: 8 explores again
    assert turns.choose(8, predicted=DRAFT) == DRAFT


def test_without_exploring_a_plain_prediction_is_trusted_until_drafting_is_measured():
    turns = MeasuredTurns(min_turns=1, explore_every=100)
    turns.record(4, PLAIN, tokens=30, seconds=1.0)
    assert turns.choose(4, predicted=PLAIN) == DRAFT  # exploring: the young arm is tried
    assert turns.choose(4, predicted=PLAIN, explore=False) == PLAIN
    turns.record(4, DRAFT, tokens=60, seconds=1.0)  # measured after all (a trial from elsewhere): it decides
    assert turns.choose(4, predicted=PLAIN, explore=False) == DRAFT
