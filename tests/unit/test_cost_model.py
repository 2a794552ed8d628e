"""Block length by cost: the measured (uneven) verify curve decides, and the target alone competes."""

import pytest

from services.config import SpeculativeSettings
from services.speculative.block_length import BlockLengthController
from services.speculative.cost_model import CostModel, alpha_from_rounds, best_block_length

# the uneven CPU curve from the issue: 1 token 43 ms, 2 tokens 73, 3 tokens 91, 5 tokens 71, 9 tokens 80
UNEVEN = CostModel({1: 43.0, 2: 73.0, 3: 91.0, 5: 71.0, 9: 80.0}, draft_ms_per_token=0.1)


def test_verify_cost_is_measured_or_interpolated():
    assert UNEVEN.verify_cost(5) == 71.0
    assert UNEVEN.verify_cost(4) == pytest.approx((91.0 + 71.0) / 2)
    assert UNEVEN.verify_cost(7) == pytest.approx(71.0 + 0.5 * (80.0 - 71.0))
    assert UNEVEN.verify_cost(12) == 80.0  # flat past the longest measured
    with pytest.raises(ValueError, match="1-token"):
        CostModel({4: 10.0})


def test_uneven_curve_skips_the_expensive_short_blocks():
    # by hand: tokens (1 - a^(g+1)) / (1 - a) over g * 0.1 ms + verify(g + 1)
    a = 0.6
    verify = {2: 73.0, 3: 91.0, 4: 81.0, 5: 71.0, 6: 73.25, 7: 75.5, 8: 77.75, 9: 80.0}
    rate = {g: (1 - a ** (g + 1)) / (1 - a) / (g * 0.1 + verify[g + 1]) for g in range(1, 9)}
    best = max(rate, key=rate.get)
    gamma, speedup = best_block_length(a, UNEVEN, range(1, 9))
    assert gamma == best == 5  # not the short blocks: 2 and 3 tokens cost more than 5 here
    assert speedup == pytest.approx(rate[5] * 43.0)


def test_target_alone_wins_when_no_block_pays():
    gamma, speedup = best_block_length(0.3, UNEVEN, range(1, 9))
    assert gamma == 0 and speedup == 1.0
    smooth = CostModel({1: 40.0, 9: 44.0})
    assert best_block_length(0.3, smooth, range(1, 9))[0] >= 1  # nearly free verification: draft anyway


def test_alpha_is_the_geometric_maximum_likelihood():
    assert alpha_from_rounds([(4, 4), (4, 1)]) == pytest.approx(5 / 6)  # 5 successes, 1 failure
    assert alpha_from_rounds([(3, 0)]) == 0.0
    assert alpha_from_rounds([]) is None


def test_controller_in_cost_mode_follows_the_curve_and_falls_back():
    config = SpeculativeSettings(block_policy="cost", num_draft_tokens=2, fallback_below=0.0, fallback_min_rounds=3)
    controller = BlockLengthController(config, cost=UNEVEN)
    for _ in range(3):
        controller.update(4, 2)  # alpha = 2/3
    assert controller.num_draft_tokens == best_block_length(2 / 3, UNEVEN, range(1, 9))[0] > 2
    for _ in range(10):
        controller.update(controller.num_draft_tokens or 1, 0)
    assert controller.fallen_back and controller.num_draft_tokens == 0
