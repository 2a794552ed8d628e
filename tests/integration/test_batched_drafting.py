"""Model drafts of many sessions stepped together give every session the block it would get alone."""

from __future__ import annotations

import pytest
import torch

from services.models.drafters import DraftSource, ModelDrafter
from services.models.drafters.batched import DraftCall, EngineDrafter, bound_draft_context, propose_many
from services.models.drafters.hybrid import HybridDrafter
from services.models.drafters.ngram import NgramDrafter
from services.models.trimmed_draft import TrimmedDraft
from services.models.loading import LoadedModel
from services.speculative.params import SamplingParams
from tests.conftest import TINY_VOCAB, build_tiny_llama

GREEDY = SamplingParams()


def contexts(count: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(0, TINY_VOCAB, (int(length),), generator=generator).tolist()
            for length in torch.randint(2, 40, (count,), generator=generator)]


def test_int8_drafts_keep_a_cache_per_session():
    """Dynamic int8 scales activations per tensor: rows of one forward would change each other's blocks."""
    source = DraftSource("int8", build_tiny_llama(0).with_precision("int8"))
    assert isinstance(source.new_drafter(), ModelDrafter)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_batched_blocks_equal_blocks_drafted_alone(precision):
    target = build_tiny_llama(0)
    source = DraftSource(f"self:{precision}", target.with_precision(precision))
    drafters = [source.new_drafter() for _ in range(5)]
    assert all(isinstance(drafter, EngineDrafter) for drafter in drafters)
    calls = [DraftCall(drafter, context, 2 + index, GREEDY, None)
             for index, (drafter, context) in enumerate(zip(drafters, contexts(5)))]
    together = propose_many(calls)
    for call, proposal in zip(calls, together):
        alone = ModelDrafter(source.model).propose(call.context_ids, call.num_draft_tokens, GREEDY, None)
        assert proposal.token_ids == alone.token_ids
    # next round: a context that kept part of the block (the KV is cropped to the agreed prefix)
    again = [DraftCall(call.drafter, [*call.context_ids, proposal.token_ids[0], 7], 3, GREEDY, None)
             for call, proposal in zip(calls, together)]
    for call, proposal in zip(again, propose_many(again)):
        assert proposal.token_ids == ModelDrafter(source.model).propose(call.context_ids, 3, GREEDY, None).token_ids


def test_sampled_batched_blocks_draw_from_each_sessions_own_stream():
    target = build_tiny_llama(1)
    source = DraftSource("self:fp32", target.with_precision("fp32"))
    sampling = SamplingParams(temperature=0.9, top_k=20, seed=3)
    batch = contexts(4)
    together = propose_many([DraftCall(source.new_drafter(), context, 4, sampling,
                                       sampling.make_stream("draft", index)) for index, context in enumerate(batch)])
    for index, (context, proposal) in enumerate(zip(batch, together)):
        alone = ModelDrafter(source.model).propose(context, 4, sampling, sampling.make_stream("draft", index))
        assert proposal.token_ids == alone.token_ids
        torch.testing.assert_close(proposal.probs, alone.probs, atol=1e-5, rtol=1e-4)


def test_hybrids_batch_their_model_half_and_keep_lookup_first():
    target = build_tiny_llama(2)
    source = DraftSource("hybrid:self:fp32", target.with_precision("fp32"), hybrid=True, ngram_min=2)
    drafters = [source.new_drafter() for _ in range(3)]
    assert all(isinstance(drafter, HybridDrafter) for drafter in drafters)
    repeating = [4, 8, 15, 16, 4, 8]  # prompt lookup proposes 15, 16
    calls = [DraftCall(drafters[0], repeating, 2, GREEDY, None),
             DraftCall(drafters[1], [1, 2, 3, 5], 3, GREEDY, None), DraftCall(drafters[2], [9, 10, 11], 3, GREEDY, None)]
    proposals = propose_many(calls)
    assert proposals[0].token_ids == [15, 16] and drafters[0].num_lookup_rounds == 1
    for call, proposal in zip(calls[1:], proposals[1:]):
        assert proposal.token_ids == ModelDrafter(source.model).propose(call.context_ids, 3, GREEDY, None).token_ids
    assert propose_many([DraftCall(NgramDrafter(), repeating, 2, GREEDY, None)])[0].token_ids == [15, 16]


def test_trimmed_drafts_run_on_the_packed_forward():
    target = build_tiny_llama(3)
    keep_ids = torch.arange(0, TINY_VOCAB, 2)
    draft = TrimmedDraft(target.model, num_layers=1, keep_ids=keep_ids, init_from_layers=[0]).eval()
    loaded = LoadedModel("trimmed", draft, None)
    source = DraftSource("trimmed", loaded)
    drafter = source.new_drafter()
    assert isinstance(drafter, EngineDrafter)
    for context in contexts(3):
        proposal = drafter.propose(context, 4, GREEDY, None)
        assert proposal.token_ids == ModelDrafter(loaded).propose(context, 4, GREEDY, None).token_ids
        assert all(token % 2 == 0 for token in proposal.token_ids)  # only kept tokens are ever drafted


def test_the_draft_profile_times_batched_steps_of_model_drafts_only():
    from services.engine.profile import measure_draft_profile

    target = build_tiny_llama(0)
    model = measure_draft_profile(DraftSource("self:fp32", target.with_precision("fp32")), 40,
                                  batch_sessions=(3,))
    assert set(model) == {"draft_ms_per_token", "draft_step_ms_3"} and model["draft_step_ms_3"] > 0
    assert set(measure_draft_profile(DraftSource("ngram", None), TINY_VOCAB)) == {"draft_ms_per_token"}


def test_a_bounded_draft_reads_the_last_tokens_of_the_prompt_and_all_that_follows():
    """draft_context_tokens: a long prompt costs the draft the window's prefill, not the whole prompt; the
    blocks are those of a draft given only the window; what follows the prompt is all read; prompt lookup (a
    hybrid's other half) still sees the whole prompt."""
    source = DraftSource("self:fp32", build_tiny_llama(2).with_precision("fp32"))
    prompt = contexts(1)[0] * 3  # 6 to 117 tokens, repeated
    window = 8
    bounded = source.new_drafter()
    bound_draft_context(bounded, len(prompt), window)
    assert bounded.start == len(prompt) - window
    first = bounded.propose(prompt, 3, GREEDY, None)
    assert bounded.sequence.length == window + 2  # the window, then the first two drafted tokens
    alone = ModelDrafter(source.model).propose(prompt[-window:], 3, GREEDY, None)
    assert first.token_ids == alone.token_ids
    grown = [*prompt, *first.token_ids[:2], 11, 12]  # a round committed, another one's tokens after it
    assert bounded.missing(grown) == 1  # the drafted tokens kept, 11 to feed (12 is fed for its logits)
    assert bounded.propose(grown, 3, GREEDY, None).token_ids == \
        ModelDrafter(source.model).propose(grown[-window - 4:], 3, GREEDY, None).token_ids
    short = source.new_drafter()
    bound_draft_context(short, 5, window)  # a prompt shorter than the window: all of it
    assert short.start == 0
    hybrid = HybridDrafter(NgramDrafter(), source.new_drafter())
    bound_draft_context(hybrid, len(prompt), window)
    assert hybrid.model.start == len(prompt) - window
    unbounded = source.new_drafter()
    bound_draft_context(unbounded, len(prompt), 0)
    assert unbounded.start == 0
