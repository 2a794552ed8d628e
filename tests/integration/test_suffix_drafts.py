"""Suffix drafts on tiny random models: greedy output identical to target-only, sampled output from the target's
distribution, the per-round choice drafting in batches; the fleet's history through a real Redis."""

from __future__ import annotations

import redis
import torch
from scipy.stats import chisquare

from services.config import SpeculativeSettings, SuffixSettings
from services.engine import GenerationOptions, GenerationSession
from services.history_feed import HistoryFeed, append_finished
from services.models.drafters import DraftSource
from services.models.drafters.batched import DraftCall, propose_many
from services.models.drafters.history import History
from services.models.drafters.suffix import SuffixDrafter, SuffixModelDrafter
from services.protocol import HISTORY_STREAM_KEY, FinishedOutput
from services.speculative.params import SamplingParams
from services.speculative.sampling import warp_logits
from tests.conftest import TINY_VOCAB, build_tiny_llama

REPEATED = [5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 5, 6, 7]


def run(target, drafter, prompt, max_new_tokens, sampling=None, gamma=4):
    speculative = SpeculativeSettings(num_draft_tokens=gamma, min_draft_tokens=gamma, max_draft_tokens=gamma,
                                      fallback_below=0.0)
    options = GenerationOptions(max_new_tokens=max_new_tokens, speculative=speculative, ignore_eos=True,
                                sampling=sampling or SamplingParams())
    session = GenerationSession(target, drafter, prompt, options)
    while not session.finished:
        session.step()
    return session


def test_greedy_suffix_drafts_equal_target_only():
    for seed in range(3):
        target = build_tiny_llama(seed)
        prompts = [REPEATED, torch.randint(0, TINY_VOCAB, (30,), generator=torch.Generator().manual_seed(seed)).tolist()]
        history = History(capacity=4096)
        for prompt in prompts:
            expected = run(target, None, prompt, 48).output_ids
            for gamma in (1, 3, 8):
                # the second pass drafts from the first's output as well (the tenant's history)
                for _ in range(2):
                    drafter = SuffixDrafter(history, tenant="t")
                    session = run(target, drafter, prompt, 48, gamma=gamma)
                    assert session.output_ids == expected, f"seed {seed} gamma {gamma}"
            assert drafter.num_history_drafts + drafter.num_local_drafts > 0
        assert session.stats.num_draft_tokens > 0


def test_sampled_suffix_drafts_keep_the_target_distribution():
    """The first committed token after a prompt the index matches (so a draft is proposed every time) follows the
    target's warped distribution (chi-square over 800 seeded requests)."""
    target = build_tiny_llama(4)
    sampling = SamplingParams(temperature=1.0)
    with torch.no_grad():
        logits = target.model(torch.tensor([REPEATED])).logits[0, -1:].float()  # [1, vocab]
    target_probs = warp_logits(logits, sampling)[0]  # [vocab]
    num_trials = 800
    counts = torch.zeros(TINY_VOCAB)
    num_drafted = 0
    for trial in range(num_trials):
        drafter = SuffixDrafter()
        session = run(target, drafter, REPEATED, 3, sampling=SamplingParams(temperature=1.0, seed=trial), gamma=2)
        counts[session.output_ids[0]] += 1
        num_drafted += session.stats.num_draft_tokens > 0
    assert num_drafted == num_trials  # "8 9" was proposed each time
    expected = target_probs * num_trials
    common = expected >= 5
    observed = [*counts[common].tolist(), float(counts[~common].sum())]
    wanted = [*expected[common].tolist(), float(expected[~common].sum())]
    wanted = [value * num_trials / sum(wanted) for value in wanted]
    assert chisquare(observed, wanted).pvalue > 1e-3


def test_the_choice_drafts_its_model_half_in_batches_and_measures_it():
    target = build_tiny_llama(0)
    source = DraftSource("suffix:self:fp32", target.with_precision("fp32"), suffix=SuffixSettings(history_tokens=0))
    drafters = [source.new_drafter() for _ in range(3)]
    assert all(isinstance(drafter, SuffixModelDrafter) for drafter in drafters)
    open_context = torch.randint(0, TINY_VOCAB, (12,), generator=torch.Generator().manual_seed(9)).tolist()
    calls = [DraftCall(drafters[0], REPEATED, 3, SamplingParams(), None),
             DraftCall(drafters[1], open_context, 3, SamplingParams(), None),
             DraftCall(drafters[2], open_context, 3, SamplingParams(), None)]
    proposals = propose_many(calls)
    assert proposals[0].token_ids == [8, 9, 10] and drafters[0].num_lookup_rounds == 1
    model_alone = source.model
    for drafter, proposal in zip(drafters[1:], proposals[1:]):
        assert drafter.num_model_rounds == 1 and len(proposal.token_ids) == 3
        from services.models.drafters import ModelDrafter
        assert proposal.token_ids == ModelDrafter(model_alone).propose(open_context, 3, SamplingParams(),
                                                                       None).token_ids
        # the next call reads how much of the model's block the target kept
        drafter.propose([*open_context, *proposal.token_ids[:1], 0], 3, SamplingParams(), None)
        assert drafter.model_meter.num_rounds == 1


def test_the_fleet_history_goes_through_a_capped_stream(redis_url):
    client = redis.Redis.from_url(redis_url)
    history = History(capacity=4096)
    feed = HistoryFeed(client, history)
    append_finished(client, FinishedOutput(request_id="r1", tenant="key1", prompt_tail=[1, 9, 2, 3],
                                           output_ids=[501, 502, 503, 504, 505]))
    client.xadd(HISTORY_STREAM_KEY, {b"m": b"not msgpack"})  # a bad entry is skipped, not fatal
    assert feed.read_once() == 1  # the kept outputs first
    append_finished(client, FinishedOutput(request_id="r2", tenant="key2", prompt_tail=[1, 9, 2, 3],
                                           output_ids=[601, 602, 603, 604]))
    assert feed.read_once(block_ms=100) == 1
    assert history.speculate("key1", [1, 9, 2, 3, 501], 3, max_spec_factor=2).token_ids == [502, 503, 504]
    assert history.speculate("key2", [1, 9, 2, 3, 601], 3, max_spec_factor=2).token_ids == [602, 603, 604]
    assert history.speculate("key2", [1, 9, 2, 3, 501], 3).token_ids == []
    assert history.num_added == 2
