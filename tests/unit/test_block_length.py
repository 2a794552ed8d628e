from services.config import SpeculativeSettings
from services.speculative.block_length import BlockLengthController, next_block_length, within_limits

CONFIG = SpeculativeSettings(num_draft_tokens=4, min_draft_tokens=1, max_draft_tokens=8, probe_after_rounds=3)


def test_rule_grows_by_two_above_threshold_and_shrinks_by_one_otherwise():
    assert next_block_length(4, 0.81, CONFIG) == 6
    assert next_block_length(7, 0.9, CONFIG) == 8  # capped
    assert next_block_length(4, 0.8, CONFIG) == 3  # "> 0.8" is strict
    assert next_block_length(1, 0.1, CONFIG) == 1  # floored


def test_full_acceptance_climbs_to_max():
    controller = BlockLengthController(CONFIG)
    seen = []
    for _ in range(4):
        gamma = controller.num_draft_tokens
        controller.update(gamma, gamma)
        seen.append(controller.num_draft_tokens)
    assert seen == [6, 8, 8, 8]


def test_window_mean_decides_not_last_round():
    controller = BlockLengthController(CONFIG.model_copy(update={"fallback_min_rounds": 10}))
    for _ in range(9):
        controller.update(4, 4)
    before = controller.num_draft_tokens
    controller.update(before, 0)  # one bad round; the window is still > 0.8 on average
    assert controller.window_acceptance > 0.8
    assert controller.num_draft_tokens == min(before + 2, 8)


def test_low_acceptance_falls_back_then_probes_again():
    controller = BlockLengthController(CONFIG)
    for _ in range(CONFIG.fallback_min_rounds - 1):
        controller.update(controller.num_draft_tokens, 0)
        assert not controller.fallen_back
    controller.update(controller.num_draft_tokens, 0)
    assert controller.fallen_back and controller.num_draft_tokens == 0
    assert controller.num_fallbacks == 1
    for _ in range(CONFIG.probe_after_rounds):
        assert controller.num_draft_tokens == 0
        controller.update(0, 0)
    assert not controller.fallen_back
    assert controller.num_draft_tokens == CONFIG.min_draft_tokens
    assert controller.window_acceptance == 0.0  # fresh window


def test_probe_disabled_means_fallback_for_good():
    controller = BlockLengthController(CONFIG.model_copy(update={"probe_after_rounds": 0}))
    for _ in range(CONFIG.fallback_min_rounds):
        controller.update(controller.num_draft_tokens or 1, 0)
    for _ in range(1000):
        controller.update(0, 0)
    assert controller.num_draft_tokens == 0


def test_rounds_without_draft_do_not_move_gamma():
    controller = BlockLengthController(CONFIG)
    controller.update(0, 0)
    assert controller.num_draft_tokens == 4 and not controller.fallen_back


def test_a_block_stays_within_the_requests_limits():
    assert within_limits(5, 100) == 5
    assert within_limits(5, 3) == 2  # a round emits up to gamma + 1 tokens: never past the last one
    assert within_limits(5, 1) == 0 and within_limits(5, 0) == 0  # the last token: a plain round
    assert within_limits(5, 100, 3, None) == 3  # a degraded pool's cap; None caps nothing
    assert within_limits(5, 100, None, 4, 2) == 2  # the lowest cap wins (the KV cache's room)
