"""Block length by cost: the measured (uneven) verify curve decides, and the target alone competes."""

import dataclasses

import pytest

from services.config import SpeculativeSettings
from services.speculative.block_length import LOAD_PLAIN_ROUNDS, BlockLengthController, RecentRounds
from services.speculative.cost_model import CostModel, alpha_from_rounds, best_block_length

# the uneven CPU curve from the issue: 1 token 43 ms, 2 tokens 73, 3 tokens 91, 5 tokens 71, 9 tokens 80; drafted
# one block after another (not pipelined), so that a round pays all its drafting, as the sums by hand below do
UNEVEN = CostModel({1: 43.0, 2: 73.0, 3: 91.0, 5: 71.0, 9: 80.0}, draft_ms_per_token=0.1, pipelined=False)


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


# A CPU-like grid: steps of 1..16 rows of 1..9 tokens; extra tokens are cheap alone, dear in a full step.
LOADED = CostModel.from_profile({
    "verify_ms_1": 30.0, "verify_ms_2": 40.0, "verify_ms_5": 52.0, "verify_ms_9": 70.0,
    "step_ms_4x1": 50.0, "step_ms_4x2": 62.0, "step_ms_4x5": 110.0, "step_ms_4x9": 160.0,
    "step_ms_16x1": 85.0, "step_ms_16x2": 130.0, "step_ms_16x5": 210.0, "step_ms_16x9": 330.0,
    "draft_ms_per_token": 0.01})


def test_step_cost_reads_the_grid_interpolates_and_extrapolates():
    assert LOADED.step_cost(1, 5) == 52.0 and LOADED.step_cost(16, 2) == 130.0
    assert LOADED.step_cost(10, 1) == pytest.approx(50.0 + (10 - 4) / 12 * 35.0)  # between 4 and 16 rows
    assert LOADED.step_cost(4, 3) == pytest.approx(62.0 + (110.0 - 62.0) / 3)  # between 2 and 5 tokens
    assert LOADED.step_cost(32, 1) == pytest.approx(85.0 + 16 * 35.0 / 12)  # past 16 rows: the last slope
    assert UNEVEN.step_cost(16, 5) == UNEVEN.verify_cost(5)  # no grid measured: the one-row curve


def test_drafting_pays_alone_and_stops_paying_under_load():
    alone, _ = best_block_length(0.45, LOADED, range(1, 9), rows=1)
    loaded, speedup = best_block_length(0.45, LOADED, range(1, 9), rows=16)
    assert alone >= 2 and loaded == 0 and speedup == 1.0
    # by hand at 16 rows: plain 1 / 85 tokens per ms beats a block of one, 1.45 / 130
    assert 1 / 85.0 > (1 + 0.45) / (0.01 + 130.0)


def test_controller_follows_the_load_reported_by_verdicts():
    config = SpeculativeSettings(block_policy="cost", fallback_below=0.0)
    controller = BlockLengthController(config, cost=LOADED)
    for _ in range(5):
        controller.update(4, 1)  # alpha 0.5
    assert controller.num_draft_tokens > 0 and controller.num_plain_rounds == 0
    controller.observe_load(16)
    assert controller.num_draft_tokens == 0 and controller.num_plain_rounds == LOAD_PLAIN_ROUNDS
    assert not controller.fallen_back  # the load, not the draft: drafting resumes when the load drops
    controller.observe_load(1)
    assert controller.num_draft_tokens > 0


def test_a_prior_that_says_drafting_does_not_pay_starts_plain_unless_exploring():
    config = SpeculativeSettings(block_policy="cost")
    assert BlockLengthController(config, cost=LOADED, prior=0.1, explore=False).fallen_back
    explorer = BlockLengthController(config, cost=LOADED, prior=0.1, explore=True)
    assert not explorer.fallen_back and explorer.num_draft_tokens == config.min_draft_tokens  # probes alone
    explorer.observe_load(16)
    assert explorer.num_draft_tokens == 0  # but never under load, where a probe slows every row
    explorer.observe_load(1, draft_sessions=16)  # a step of one row (an opening's last chunk), a busy draft
    assert explorer.num_draft_tokens == 0  # nor for a remote draft shared by 16 (the probe's prefill is its)
    explorer.observe_load(1, draft_sessions=1)
    assert explorer.num_draft_tokens == config.min_draft_tokens
    assert not BlockLengthController(config, cost=LOADED, prior=0.9, explore=False).fallen_back


def test_recent_rounds_give_the_prior_and_the_load():
    recent = RecentRounds(min_rounds=3, explore_every=4)
    recent.observe(4, 4, rows=3)
    recent.observe(0, 0, rows=5)  # a target-only round: the load, no acceptance
    assert recent.alpha() is None and recent.rows == 5
    recent.observe(4, 0, rows=5)
    recent.observe(4, 2, rows=5)
    assert recent.alpha() == pytest.approx(6 / 8)  # 6 accepted, 2 rounds that stopped early
    assert [recent.explore() for _ in range(8)] == [True, False, False, False] * 2
    fresh = RecentRounds(min_rounds=3)
    assert all(fresh.explore() for _ in range(5))  # no evidence yet: every session tries drafting


def test_only_sessions_that_may_draft_take_a_turn_at_exploring():
    """Every explore_every-th new session probes drafting against a prior that says it loses; a plain-route
    session (no drafter) takes no turn, or a plain burst would hand the probes to no one."""
    from services.engine.draft_session import DraftSession
    from services.models.drafters.ngram import NgramDrafter
    from services.protocol import SessionSpec

    recent = RecentRounds(min_rounds=1, explore_every=2)
    recent.observe(4, 0, rows=1)  # a prior of acceptance 0: drafting loses

    def probes(route: str) -> bool:
        spec = SessionSpec(request_id="r", prompt_ids=[1, 2, 3, 1, 2, 3], max_new_tokens=32, route=route)
        session = DraftSession(spec, [], drafter=NgramDrafter(), speculative=SpeculativeSettings(), cost=UNEVEN,
                               reply_to="inbox", pipelined=False, recent=recent)
        return session.drafter is not None and not session.controller.fallen_back

    assert [probes(route) for route in ("sd", "ar", "sd", "ar", "ar", "sd", "sd")] == \
        [True, False, False, False, False, True, False]


def test_the_fallback_goes_by_pay_off_not_acceptance():
    """The 30% acceptance floor is for drafts without measured costs: under the cost policy a free draft that is
    rarely right still pays, and a draft that is often right but dear does not."""
    config = SpeculativeSettings(block_policy="cost", fallback_below=0.3, fallback_min_rounds=3)
    free = CostModel(UNEVEN.verify_ms, draft_ms_per_token=0.01)
    cheap_and_wrong = BlockLengthController(config, cost=free)
    by_acceptance = BlockLengthController(config.model_copy(update={"block_policy": "acceptance"}))
    for _ in range(6):
        cheap_and_wrong.update(4, 1)  # acceptance 0.25, below the floor
        by_acceptance.update(4, 1)
    assert cheap_and_wrong.window_acceptance == 0.25
    assert not cheap_and_wrong.fallen_back and cheap_and_wrong.num_draft_tokens > 0  # 5 tokens cost 71 ms, 1 43
    assert by_acceptance.fallen_back
    dear = CostModel(UNEVEN.verify_ms, draft_ms_per_token=5 * UNEVEN.verify_cost(1))
    accepted_but_dear = BlockLengthController(config, cost=dear)
    for _ in range(3):
        accepted_but_dear.update(4, 3)  # acceptance 0.75, well above the floor
    assert accepted_but_dear.fallen_back and accepted_but_dear.num_draft_tokens == 0


def test_a_draft_worker_shared_by_many_sessions_charges_its_batched_step():
    """16 sessions on one draft core: each waits for the batched draft step of all 16, which the flat per-token
    cost (a core per session) does not see."""
    profile = {"verify_ms_1": 30.0, "verify_ms_5": 52.0, "verify_ms_9": 70.0, "step_ms_16x1": 85.0,
               "step_ms_16x2": 95.0, "step_ms_16x5": 120.0, "step_ms_16x9": 160.0, "draft_ms_per_token": 8.0}
    flat = CostModel.from_profile(profile)
    batched = CostModel.from_profile({**profile, "draft_step_ms_4": 20.0, "draft_step_ms_16": 110.0})
    assert batched.draft_cost(1) == 8.0 and batched.draft_cost(16) == 110.0
    assert batched.draft_cost(10) == pytest.approx(20.0 + 6 * 90.0 / 12)
    assert batched.draft_cost(32) == pytest.approx(110.0 + 16 * 90.0 / 12)  # past the last: its slope
    assert flat.draft_cost(16) == 8.0
    # alone the bonus-token guess overlaps verification; on a shared draft core it is one more step to pay
    assert batched.round_ms(2, rows=1, draft_sessions=1) == 2 * 8.0 + batched.step_cost(1, 3)
    assert batched.round_ms(2, rows=4, draft_sessions=4) == 3 * 20.0 + batched.step_cost(4, 3)
    assert best_block_length(0.9, flat, range(1, 9), rows=16)[0] > 0
    assert best_block_length(0.9, batched, range(1, 9), rows=16)[0] == 0
    # with the target step at 16 rows but only 4 sessions on this draft worker, drafting pays again
    assert best_block_length(0.9, batched, range(1, 9), rows=16, draft_sessions=4)[0] > 0
    controller = BlockLengthController(SpeculativeSettings(block_policy="cost"), cost=batched, prior=0.9)
    controller.observe_load(16, draft_sessions=16)
    assert controller.num_draft_tokens == 0
    controller.observe_load(16, draft_sessions=2)
    assert controller.num_draft_tokens > 0
    # 16 sessions on this draft worker whose drafting starves the verify worker (its steps hold 4 rows):
    # the step drafting would really share is the 16 sessions'
    controller.observe_load(4, draft_sessions=16)
    assert controller.num_draft_tokens == 0


def test_a_measured_cost_above_a_larger_ones_is_bounded_by_it():
    """Noise only adds time: a point costing more than a larger case was timed while the cores were busy."""
    from services.speculative.cost_model import nondecreasing

    assert nondecreasing({1: 70.0, 2: 113.0, 3: 104.0, 5: 104.0, 9: 147.0}) == {1: 70.0, 2: 104.0, 3: 104.0,
                                                                              5: 104.0, 9: 147.0}
    assert nondecreasing({4: 30.0}) == {4: 30.0}


def test_plain_decoding_never_looks_dearer_than_it_was_measured_against_longer_steps():
    """The grid a worker measured while its stack started (seen here): plain decoding at 16 rows looked dearer
    than blocks of 2 tokens, and 8 rows dearer than 16 rows would allow; read as measured, speculation looked
    cheap at load. Plain cells are bounded; longer cells stay as measured (uneven CPU curves are real)."""
    profile = {"verify_ms_1": 70.3, "verify_ms_2": 113.2, "verify_ms_5": 103.7, "verify_ms_9": 146.7,
               "step_ms_8x1": 230.0, "step_ms_8x2": 194.2, "step_ms_8x5": 583.2, "step_ms_8x9": 378.1,
               "step_ms_16x1": 273.8, "step_ms_16x2": 214.8, "step_ms_16x5": 402.1, "step_ms_16x9": 506.1,
               "draft_ms_per_token": 11.0, "draft_step_ms_4": 9.0, "draft_step_ms_16": 102.5}
    cost = CostModel.from_profile(profile)
    assert cost.verify_ms == {1: 70.3, 2: 113.2, 5: 103.7, 9: 146.7}  # the uneven one-row curve as measured
    assert cost.step_ms[16] == {1: 214.8, 2: 214.8, 5: 402.1, 9: 506.1}
    assert cost.step_ms[8] == {1: 194.2, 2: 194.2, 5: 583.2, 9: 378.1}
    assert cost.draft_step_ms == {4: 11.0, 16: 102.5}  # a batched step is never cheaper than one session's
    assert all(cost.step_cost(rows, 1) <= cost.step_cost(rows, n) for rows in (8, 16) for n in (2, 5, 9))


def test_a_rounds_overhead_makes_longer_blocks_pay():
    """What a round costs beyond its forwards (measured live when co-located) is paid once per round, so it
    favours longer blocks: by hand, at acceptance 0.9, a linear verify curve and a draft step of 10 ms."""
    a, curve = 0.9, {1: 30.0, 9: 70.0}

    def by_hand(gamma: int, overhead: float) -> float:
        return (1 - a ** (gamma + 1)) / (1 - a) / (gamma * 10.0 + 30.0 + 5.0 * gamma + overhead)

    for overhead in (0.0, 60.0):
        cost = CostModel(curve, draft_ms_per_token=10.0, round_overhead_ms=overhead, pipelined=False)
        rates = {gamma: by_hand(gamma, overhead) for gamma in range(1, 9)}
        assert best_block_length(a, cost, range(1, 9))[0] == max(rates, key=rates.get)
        assert cost.round_ms(3) == pytest.approx(30.0 + 15.0 + 30.0 + overhead)
    assert best_block_length(a, CostModel(curve, draft_ms_per_token=10.0, round_overhead_ms=60.0, pipelined=False),
                             range(1, 9))[0] > \
        best_block_length(a, CostModel(curve, draft_ms_per_token=10.0, pipelined=False), range(1, 9))[0]


def test_a_co_located_drafts_prompt_prefill_is_paid_by_every_row_of_the_step():
    """draft_prefill_ms_per_token: each drafted round's tokens carry the draft's prefill of the prompts it
    read, for every row of the step: a lone stream still drafts, 16 rows decode plain."""
    base = dict(draft_ms_per_token=2.0, step_ms={16: {1: 160.0, 5: 200.0}}, pipelined=False)
    free, charged = CostModel({1: 30.0, 5: 40.0}, **base), CostModel({1: 30.0, 5: 40.0}, **base,
                                                                         draft_prefill_ms_per_token=10.0)
    tokens = 1 + 0.9 + 0.81 + 0.729 + 0.6561
    assert charged.tokens_per_ms(0.9, 4) == pytest.approx(tokens / (8.0 + 40.0 + tokens * 10.0))
    assert charged.tokens_per_ms(0.9, 0, 16) == free.tokens_per_ms(0.9, 0, 16)  # plain decoding pays none
    assert best_block_length(0.9, charged, range(1, 5), 1)[0] > 0
    assert best_block_length(0.9, free, range(1, 5), 16)[0] > 0
    assert best_block_length(0.9, charged, range(1, 5), 16)[0] == 0


def test_a_pipelined_draft_alone_waits_only_for_the_drafting_its_verification_did_not_hide():
    """Alone, a pipelined draft drafts the next block (after its guess of the bonus token) while this one is
    verified: accepted whole with the bonus guessed (alpha^(gamma + 1)) the round waits only for what outlasted the
    verification; else for the whole block, drafted after the verdict. Sharing the draft worker, every step."""
    cost = CostModel({1: 50.0, 3: 60.0, 5: 90.0}, draft_ms_per_token=20.0)
    hit = 0.9 ** 3
    assert cost.drafting_ms(2, 1, alpha=0.9) == pytest.approx((1 - hit) * 40.0 + hit * 0.0)  # 60 ms drafted in 60
    hit = 0.9 ** 5
    assert cost.drafting_ms(4, 1, alpha=0.9) == pytest.approx((1 - hit) * 80.0 + hit * (100.0 - 90.0))
    assert cost.round_ms(2, alpha=0.9) == pytest.approx(cost.drafting_ms(2, 1, alpha=0.9) + 60.0)
    assert cost.drafting_ms(2, 4, alpha=0.9) == 3 * 20.0  # four sessions on its core: the guess is paid too
    assert cost.drafting_ms(2, 1) == 40.0  # no acceptance given: all of it
    serial = dataclasses.replace(cost, pipelined=False)
    assert serial.drafting_ms(2, 1, alpha=0.9) == 40.0
    assert cost.tokens_per_ms(0.9, 2) > serial.tokens_per_ms(0.9, 2)


def test_the_plain_arm_is_priced_at_what_target_only_steps_cost_where_they_run_wider():
    """On one box a verify worker runs target-only steps on the draft worker's idle core too; its start-up timings
    of those steps (plain_ms_<rows>) price the plain arm, never above the grid. Built-in pair, 2-core AMX Xeon:
    one row 53 ms narrow, 31 ms wide; a draft at 19 ms a token (the profiles seen this session)."""
    profile = {"verify_ms_1": 54.8, "verify_ms_2": 54.4, "verify_ms_3": 57.2, "verify_ms_4": 83.1,
               "verify_ms_5": 86.9, "step_ms_8x1": 116.6, "step_ms_8x3": 128.9, "draft_ms_per_token": 19.2}
    plain = {"plain_ms_1": 31.4, "plain_ms_2": 35.0, "plain_ms_4": 66.4, "plain_ms_8": 62.0}
    narrow, wide = CostModel.from_profile(profile), CostModel.from_profile({**profile, **plain})
    assert wide.plain_ms == {1: 31.4, 2: 35.0, 4: 66.4, 8: 62.0}
    assert wide.plain_cost(1) == 31.4 and wide.plain_cost(3) == pytest.approx((35.0 + 66.4) / 2)
    assert wide.plain_cost(16) == pytest.approx(min(wide.step_cost(16, 1), 62.0 * wide.step_cost(16, 1) / 116.6))
    assert narrow.plain_cost(1) == 54.4 and narrow.round_ms(0) == 54.4  # the grid (cleaned: 2 tokens cost 54.4)
    assert wide.round_ms(0) == 31.4 and wide.round_ms(2, alpha=0.9) == narrow.round_ms(2, alpha=0.9)
    # the drafted arm is unchanged; against the wider plain steps drafting pays less, and a slow link sooner loses
    assert best_block_length(0.9, wide, range(1, 5))[1] < best_block_length(0.9, narrow, range(1, 5))[1]
    linked = dataclasses.replace(wide, link_ms=100.0, blocks_ahead=2)
    assert best_block_length(0.9, linked, range(1, 5))[0] == 0
    assert best_block_length(0.9, dataclasses.replace(narrow, link_ms=100.0, blocks_ahead=2), range(1, 5))[0] > 0
    with pytest.raises(ValueError, match="one row"):
        CostModel({1: 50.0}, plain_ms={2: 30.0})
