"""Suffix drafts: the session's own context, the tenant's history (and only its own), the per-round choice."""

from __future__ import annotations

import pytest

from services.models.drafters.history import History
from services.models.drafters.ngram import NgramDrafter
from services.models.drafters.suffix import (
    Acceptance,
    AcceptanceMeter,
    SuffixDrafter,
    SuffixModelDrafter,
    SuffixOptions,
    bind_tenant,
)
from services.speculative.draft_choice import DraftPrices, model_rate, suffix_pays, suffix_rate
from services.speculative.params import SamplingParams

GREEDY = SamplingParams()
ANSWER = [501, 502, 503, 504, 505, 506, 507, 508, 509, 510]
CHAT_TAIL = [1, 9, 2, 3]  # the chat template's last prompt tokens before an answer


def test_drafts_come_from_the_conversation_as_point_masses():
    drafter = SuffixDrafter()
    context = [40, 41, 42, 43, 44, 45, 46, 7, 40, 41, 42]
    proposal = drafter.propose(context, 3, GREEDY, None)
    assert proposal.token_ids == [43, 44, 45] and proposal.probs is None
    assert drafter.num_local_drafts == 1 and drafter.num_history_drafts == 0


def test_a_rejected_speculated_tail_is_forgotten():
    drafter = SuffixDrafter()
    drafter.propose([40, 41, 42, 43, 44, 7, 40, 41, 99, 98], 2, GREEDY, None)  # "40 41 99 98" was speculated
    # the target kept "40 41 42" instead: the index must not offer "99" after "40 41" any more
    assert drafter.propose([40, 41, 42, 43, 44, 7, 40, 41], 2, GREEDY, None).token_ids == [42, 43]


def test_a_tenant_drafts_from_its_own_history_only():
    history = History(capacity=4096)
    history.add("key1", CHAT_TAIL, ANSWER)
    own, other = SuffixDrafter(history), SuffixDrafter(history)
    bind_tenant(own, "key1")
    bind_tenant(other, "key2")
    prompt = [300, 301, 302, *CHAT_TAIL, *ANSWER[:2]]
    assert own.propose(prompt, 4, GREEDY, None).token_ids == ANSWER[2:6]
    assert own.num_history_drafts == 1
    assert other.propose(prompt, 4, GREEDY, None).token_ids == []  # key2 never sees key1's text
    # with a cache_salt the tenant is the key's salt: another salt of the same key is another tenant
    salted = SuffixDrafter(history)
    bind_tenant(salted, "key1/team-a")
    assert salted.propose(prompt, 4, GREEDY, None).token_ids == []


def test_the_operator_can_pool_every_tenant():
    history = History(capacity=4096, share_across_tenants=True)
    history.add("key1", CHAT_TAIL, ANSWER)
    drafter = SuffixDrafter(history, tenant="key2")
    assert drafter.propose([*CHAT_TAIL, *ANSWER[:3]], 3, GREEDY, None).token_ids == ANSWER[3:6]


def test_history_memory_is_bounded_by_tenants_and_capacity():
    history = History(capacity=2048, max_tenants=2)
    for tenant in ("a", "b", "c"):
        history.add(tenant, CHAT_TAIL, ANSWER)
    assert history.num_tenants == 2 and history.num_evicted_tenants == 1
    one = history.memory_bytes / 2
    for round_ in range(100):
        history.add("b", CHAT_TAIL, [1000 + round_ * 40 + i for i in range(40)])
    assert history.memory_bytes == 2 * one  # a flood of unique text evicts, it does not grow
    assert history.speculate("a", [*CHAT_TAIL, *ANSWER[:2]], 3).token_ids == []  # "a" was the least recent


def test_a_finished_in_process_session_joins_its_tenants_history():
    history = History(capacity=4096)
    first = SuffixDrafter(history, tenant="t")
    first.remember([5, 6, *CHAT_TAIL], ANSWER)
    second = SuffixDrafter(history, tenant="t")
    assert second.propose([7, 7, *CHAT_TAIL, *ANSWER[:4]], 3, GREEDY, None).token_ids == ANSWER[4:7]


def test_the_acceptance_meter_reads_what_the_target_kept():
    meter = AcceptanceMeter(estimate=Acceptance(alpha=0.5, weight=1.0))
    meter.proposed(3, [7, 8, 9], expected=2.0)
    meter.observe([1, 2, 3])  # not verified yet
    assert meter.num_rounds == 0
    meter.observe([1, 2, 3, 7, 8, 4])  # two kept, the third replaced by the target's own
    assert (meter.num_rounds, meter.num_accepted, meter.num_drafted) == (1, 2, 3)
    assert meter.alpha == pytest.approx(2 / 3) and meter.calibration == pytest.approx(1.0)
    meter.proposed(6, [5, 5], expected=2.0)
    meter.observe([1, 2, 3, 7, 8, 4, 6])  # none kept
    assert meter.alpha == 0.0 and meter.calibration == 0.0


def test_the_choice_takes_a_sure_suffix_draft_and_the_model_otherwise():
    prices = DraftPrices(model_draft=0.3, verify_growth=0.05)
    drafter = SuffixModelDrafter(SuffixDrafter(prices=prices), NgramDrafter(ngram_max=2, ngram_min=1),
                                 prior_alpha=0.6)
    repeated = [40, 41, 42, 43, 44, 45, 46, 47, 48, 7, 40, 41, 42, 43, 44]
    assert drafter.propose(repeated, 4, GREEDY, None).token_ids == [45, 46, 47, 48]
    assert drafter.num_lookup_rounds == 1
    assert drafter.propose([60, 61, 62, 61], 4, GREEDY, None).token_ids == [62, 61]  # no suffix match: model half
    assert drafter.num_model_rounds == 1


def test_the_choice_is_tokens_per_cost():
    prices = DraftPrices(model_draft=0.3, verify_growth=0.05)
    assert suffix_rate(3.0, 4, prices) == pytest.approx(4.0 / 1.2)
    assert model_rate(0.9, 4, prices) == pytest.approx((1 + 0.9 + 0.81 + 0.729 + 0.6561) / (1.2 + 1.2))
    # a sure 4-token suffix draft beats a good model draft that costs a core ...
    assert suffix_pays(3.5, 4, model_alpha=0.9, model_tokens=4, prices=prices)
    # ... a shaky one-token suffix draft does not
    assert not suffix_pays(0.3, 1, model_alpha=0.9, model_tokens=4, prices=prices)
    # with a free model draft, the better acceptance wins
    free = DraftPrices(model_draft=0.0, verify_growth=0.05)
    assert not suffix_pays(1.0, 4, model_alpha=0.9, model_tokens=4, prices=free)
    assert not suffix_pays(5.0, 0, model_alpha=0.1, model_tokens=4, prices=prices)  # nothing to send
    assert suffix_pays(0.5, 2, model_alpha=0.9, model_tokens=0, prices=prices)


def test_a_sure_long_match_is_drafted_past_the_length_asked_as_far_as_it_pays():
    drafter = SuffixDrafter(options=SuffixOptions(max_spec_factor=2.0, max_draft_tokens=12),
                            prices=DraftPrices(verify_curve={1: 1.0, 2: 1.1, 8: 1.5, 16: 2.0}))
    context = [*range(100, 130), 7, *range(100, 110)]
    assert len(drafter.propose(context, 4, GREEDY, None).token_ids) == 4  # no room given: as asked
    assert drafter.propose(context, 4, GREEDY, None, max_draft_tokens=40).token_ids == list(range(110, 122))
    assert drafter.propose(context, 4, GREEDY, None, max_draft_tokens=6).token_ids == list(range(110, 116))
    # where verifying costs more than a shaky token is worth, the draft is cut short
    dear = SuffixDrafter(prices=DraftPrices(verify_curve={1: 1.0, 2: 2.0, 3: 3.0}))
    dear.history = History(capacity=1024)
    for follow in (1, 2, 3):
        dear.history.add("", [], [50, 51, 52, follow])
    assert dear.propose([50, 51, 52], 4, GREEDY, None).token_ids == []


def test_options_bound_the_draft_by_its_match():
    drafter = SuffixDrafter(options=SuffixOptions(max_spec_factor=1.0, max_spec_offset=0.0, min_match=3))
    context = [*range(10, 40), 1, 10, 11]
    assert drafter.propose(context, 8, GREEDY, None).token_ids == []  # a 2-token match is under min_match
    assert drafter.propose([*context, 12], 8, GREEDY, None).token_ids == [13, 14, 15]


def test_rounds_are_counted_by_who_drafted_them():
    from services.speculative.stats import SpecDecodingStats

    stats = SpecDecodingStats()
    stats.observe(4, 3, "suffix")
    stats.observe(6, 6, "history")
    stats.observe(2, 1)  # the model draft
    stats.observe(0, 0, "suffix")  # a target-only round drafts nothing
    assert (stats.num_drafts, stats.num_suffix_drafts, stats.num_history_drafts) == (3, 2, 1)
    assert (stats.num_suffix_draft_tokens, stats.num_suffix_accepted_tokens) == (10, 9)
    assert SpecDecodingStats.from_wire(stats.to_wire()) == stats
    older = SpecDecodingStats.from_wire({"num_drafts": 2, "num_draft_tokens": 5})  # a message from before
    assert older.num_suffix_drafts == 0
    merged = stats.copy()
    merged.merge(stats)
    assert merged.num_history_drafts == 2 and merged.num_suffix_accepted_tokens == 18


def test_a_long_unread_prompt_charges_the_model_draft_its_prefill_shared_by_the_rounds_left():
    from services.speculative.draft_choice import prefill_share

    prices = DraftPrices(model_draft=0.3, model_prefill=0.04, verify_growth=0.05)
    assert model_rate(0.9, 4, prices) > 1.0  # it beats the target alone
    # 3,000 prompt tokens to read for 20 tokens left: the prefill outweighs what the draft saves
    assert model_rate(0.9, 4, prices, prefill_share(3000, 20, 0.9, 4, prices)) < 1.0
    # the same prompt with 2,000 tokens left: paid once, shared by every round
    assert model_rate(0.9, 4, prices, prefill_share(3000, 2000, 0.9, 4, prices)) > 1.0
    assert prefill_share(0, 20, 0.9, 4, prices) == 0.0
    # a sure suffix draft wins the round over a model draft that must read the prompt first
    shared = prefill_share(3000, 20, 0.9, 4, prices)
    assert suffix_pays(0.8, 3, model_alpha=0.9, model_tokens=4, prices=prices, model_extra_cost=shared)
    assert not suffix_pays(0.8, 3, model_alpha=0.9, model_tokens=4, prices=prices)


def test_a_session_prices_its_drafts_by_its_cost_model_and_starts_from_its_prior():
    from services.models.drafters.suffix import bind_prices
    from services.speculative.cost_model import CostModel

    drafter = SuffixModelDrafter(SuffixDrafter(), NgramDrafter())
    bind_prices(drafter, CostModel(verify_ms={1: 40.0, 2: 60.0, 8: 80.0}, draft_ms_per_token=10.0), prior=0.9)
    assert drafter.prices.model_draft == pytest.approx(0.25)
    assert drafter.prices.verify(2) == pytest.approx(1.5) and drafter.prices.verify(8) == pytest.approx(2.0)
    assert drafter.model_meter.alpha == 0.9


def test_sessions_of_one_process_start_from_what_earlier_sessions_measured():
    from services.config import SuffixSettings
    from services.models.drafters import DraftSource

    source = DraftSource("suffix", None, suffix=SuffixSettings(history_tokens=0))
    first, second = source.new_drafter(), source.new_drafter()
    first.propose([40, 41, 42, 43, 44, 7, 40, 41], 4, GREEDY, None)  # proposes 42 43 44 ...
    first.propose([40, 41, 42, 43, 44, 7, 40, 41, 9, 9], 4, GREEDY, None)  # the target kept none of it
    assert source.learned_suffix.num_rounds == 1 and source.learned_suffix.calibration < 1.0
    assert second.meter.calibration == source.learned_suffix.calibration
