"""The Leviathan bound and the per-token acceptance behind it."""

import pytest

from services.speculative.bound import alpha_from_mean_accepted, expected_accepted, leviathan_speedup


def test_expected_accepted_is_the_geometric_sum():
    assert expected_accepted(0.5, 3) == pytest.approx(0.5 + 0.25 + 0.125)
    assert expected_accepted(1.0, 4) == 4
    assert expected_accepted(0.0, 4) == 0


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.5, 0.8, 0.99])
@pytest.mark.parametrize("gamma", [1, 2.5, 4, 8])
def test_alpha_round_trips(alpha, gamma):
    assert alpha_from_mean_accepted(expected_accepted(alpha, gamma), gamma) == pytest.approx(alpha, abs=1e-6)


def test_leviathan_formula_cases():
    # paper's form (1 - a^(g+1)) / ((1 - a)(g c + 1))
    a, g, c = 0.8, 4, 0.05
    assert leviathan_speedup(a, g, c) == pytest.approx((1 - a ** (g + 1)) / ((1 - a) * (g * c + 1)))
    assert leviathan_speedup(1.0, 4, 0.0) == 5  # everything accepted, free draft: gamma + 1 tokens per forward
    assert leviathan_speedup(0.0, 4, 0.25) == pytest.approx(0.5)  # nothing accepted, costly draft: a slowdown


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="outside"):
        alpha_from_mean_accepted(5, 4)
    with pytest.raises(ValueError, match="alpha"):
        leviathan_speedup(1.5, 4, 0.1)
