"""Which steps run wide: the fewest tokens from which the wide step was faster at every larger size timed."""

from __future__ import annotations

import pytest

from services.engine.wide_steps import WIDE_MIN_TOKENS, wide_min_tokens


def timings(narrow: dict[int, float], wide: dict[int, float]) -> dict[str, float]:
    return {**{f"narrow_ms_{rows}": ms for rows, ms in narrow.items()},
            **{f"wide_ms_{rows}": ms for rows, ms in wide.items()}}


@pytest.mark.parametrize(("wide", "fewest"), [
    ({1: 35.0, 2: 41.0, 4: 57.0, 8: 73.0}, 1),  # a Xeon with AMX: two threads win from one row up
    ({1: 60.0, 2: 82.0, 4: 57.0, 8: 73.0}, 4),  # a memory-bound single row: wide from 4 rows
    ({1: 35.0, 2: 90.0, 4: 57.0, 8: 73.0}, 4),  # a win below a loss does not count
    ({1: 35.0, 2: 41.0, 4: 57.0, 8: 130.0}, WIDE_MIN_TOKENS),  # slower at the largest size timed
    ({1: 56.5, 2: 41.0, 4: 57.0, 8: 73.0}, 2),  # a tie is no win
])
def test_the_fewest_tokens_of_a_wide_step(wide, fewest):
    assert wide_min_tokens(timings({1: 56.5, 2: 81.0, 4: 97.8, 8: 124.7}, wide)) == fewest


def test_no_timings_or_a_missing_one_keeps_the_default():
    assert wide_min_tokens({}) == WIDE_MIN_TOKENS
    assert wide_min_tokens(timings({1: 50.0, 2: 60.0, 4: 70.0}, {1: 30.0, 2: 40.0, 4: 50.0, 8: 60.0})) \
        == WIDE_MIN_TOKENS
    assert wide_min_tokens(timings({1: 50.0}, {1: 30.0}), rows=(1,), ceiling=8) == 1


def test_target_only_steps_are_priced_at_the_thread_count_they_run_on():
    """The cost model's plain arm (plain_ms_<rows>): the wide timing where such steps run wide, narrow below."""
    from services.engine.wide_steps import plain_step_costs

    timed = timings({1: 56.5, 2: 81.0, 4: 97.8, 8: 124.7}, {1: 60.0, 2: 82.0, 4: 57.0, 8: 73.0})
    assert plain_step_costs(timed, wide_min_tokens(timed)) == {"plain_ms_1": 56.5, "plain_ms_2": 81.0,
                                                              "plain_ms_4": 57.0, "plain_ms_8": 73.0}
    assert plain_step_costs(timed, WIDE_MIN_TOKENS)["plain_ms_8"] == 124.7  # nothing runs wide: all narrow
    assert plain_step_costs({}, 1) == {} and plain_step_costs({"narrow_ms_1": 50.0}, 1, rows=(1,)) == {}
