"""Link levels taken in turns (services/bench/turns.py): medians, ratios turn by turn, the table."""

from __future__ import annotations

import pytest

from services.bench.capacity import capacity_figure
from services.bench.turns import median_headline, rate_keys, turn_ratios, turns_markdown

ZERO = [{"C=1 tok/s": 30.0, "C=1 stack-ar tok/s": 15.0, "capacity stack": "8"},
        {"C=1 tok/s": 20.0, "C=1 stack-ar tok/s": 10.0, "capacity stack": "8"},
        {"C=1 tok/s": 24.0, "C=1 stack-ar tok/s": None, "capacity stack": "8"}]
TWENTY = [{"C=1 tok/s": 27.0, "C=1 stack-ar tok/s": 15.0, "capacity stack": ">= 16"},
          {"C=1 tok/s": 19.0, "C=1 stack-ar tok/s": 11.0, "capacity stack": "8"},
          {"C=1 tok/s": 24.0, "C=1 stack-ar tok/s": 12.0, "capacity stack": "12"}]


def test_a_levels_figures_are_the_median_of_its_turns_and_text_is_kept_as_written():
    zero, twenty = median_headline(ZERO), median_headline(TWENTY)
    assert zero == {"C=1 tok/s": 24.0, "C=1 stack-ar tok/s": 12.5, "capacity stack": "8"}  # a turn lacking it: left out
    assert twenty["C=1 tok/s"] == 24.0 and twenty["C=1 stack-ar tok/s"] == 12.0
    assert twenty["capacity stack"] == ">= 16 / 8 / 12"
    assert capacity_figure(twenty["capacity stack"]) == 12.0 and capacity_figure(">= 16") == 16.0
    assert median_headline([{"x": None}, {"x": None}]) == {"x": None}


def test_ratios_are_taken_within_a_turn_not_across_the_drift():
    # the box slowed by a third in turn 2: across turns 20 ms would look 37% slower than 0 ms, within a turn 5%
    assert turn_ratios(ZERO, TWENTY, "C=1 tok/s") == pytest.approx([0.9, 0.95, 1.0])
    assert turn_ratios(ZERO, TWENTY, "C=1 stack-ar tok/s") == pytest.approx([1.0, 1.1, None])
    assert turn_ratios([{"r tok/s": 0.0}], [{"r tok/s": 5.0}], "r tok/s") == [None]
    assert rate_keys([ZERO, TWENTY]) == ["C=1 tok/s", "C=1 stack-ar tok/s"]


def test_the_table_has_a_row_per_later_level_and_the_median_ratio():
    table = turns_markdown(["0", "20"], [ZERO, TWENTY])
    assert "the levels taken in turn, 3 times" in table and "first level's (0)" in table
    assert "| C=1 tok/s: draft link | turn 1 | turn 2 | turn 3 | median |" in table
    assert "| 20 | 0.900 | 0.950 | 1.000 | 0.950 |" in table
    assert "| 20 | 1.000 | 1.100 | – | 1.050 |" in table
    assert turns_markdown(["0", "20"], [ZERO[:1], TWENTY[:1]]) == ""  # one turn: nothing to take in turn
    assert turns_markdown(["0"], [ZERO]) == ""
