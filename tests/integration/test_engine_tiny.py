"""Lossless greedy SD on tiny random Llama models: every drafter, gamma 1..8, several seeds."""

from __future__ import annotations

import pytest
import torch

from services.config import SpeculativeSettings
from services.engine import GenerationOptions, GenerationSession, generate
from services.engine.stopping import OutputState
from services.engine.target import TargetSession, run_step
from services.models.engine import TorchEngine
from services.errors import ContextLengthError
from services.models.drafters import DraftSource, ModelDrafter, NgramDrafter, SelfDrafter
from services.models.drafters.suffix import SuffixDrafter
from services.models.loading import LoadedModel
from services.speculative.params import SamplingParams
from tests.conftest import TINY_VOCAB, build_tiny_llama, perturbed_copy

MAX_NEW_TOKENS = 40


def prompt_for(seed: int, length: int = 12) -> list[int]:
    generator = torch.Generator().manual_seed(1000 + seed)
    return torch.randint(0, TINY_VOCAB, (length,), generator=generator).tolist()


def run(target, drafter, prompt, *, gamma=4, fixed_gamma=False, max_new_tokens=MAX_NEW_TOKENS, **kwargs):
    speculative = SpeculativeSettings(
        num_draft_tokens=gamma,
        min_draft_tokens=gamma if fixed_gamma else 1,
        max_draft_tokens=gamma if fixed_gamma else 8,
        fallback_below=0.0 if fixed_gamma else 0.3,
    )
    options = GenerationOptions(max_new_tokens=max_new_tokens, speculative=speculative, ignore_eos=True, **kwargs)
    session = GenerationSession(target, drafter, prompt, options)
    while not session.finished:
        session.step()
    return session


def reference(target: LoadedModel, prompt: list[int], max_new_tokens: int = MAX_NEW_TOKENS) -> list[int]:
    """transformers' own greedy generate: an oracle independent of our engine."""
    with torch.inference_mode():
        output = target.model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            min_new_tokens=max_new_tokens,
        )
    return output[0, len(prompt) :].tolist()


DRAFTS = {
    "model-random": lambda target, seed: ModelDrafter(build_tiny_llama(100 + seed)),
    "model-perturbed": lambda target, seed: ModelDrafter(perturbed_copy(target, scale=0.3, seed=seed)),
    "self-fp32": lambda target, seed: ModelDrafter(target.with_precision("fp32")),
    "self-int8": lambda target, seed: SelfDrafter(target, "int8"),
    "self-bf16": lambda target, seed: SelfDrafter(target, "bf16"),
    "ngram": lambda target, seed: NgramDrafter(ngram_max=3, ngram_min=1),
    "suffix": lambda target, seed: SuffixDrafter(),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_target_only_matches_transformers_generate(seed):
    target = build_tiny_llama(seed)
    prompt = prompt_for(seed)
    session = run(target, None, prompt)
    assert session.output_ids == reference(target, prompt)
    assert session.stats.num_drafts == 0 and session.stats.num_target_calls == MAX_NEW_TOKENS


@pytest.mark.parametrize("draft_name", sorted(DRAFTS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_sd_equals_target_only_for_every_gamma(draft_name, seed):
    target = build_tiny_llama(seed)
    prompt = prompt_for(seed)
    expected = reference(target, prompt)
    drafter = DRAFTS[draft_name](target, seed)
    for gamma in range(1, 9):
        session = run(target, drafter, prompt, gamma=gamma, fixed_gamma=True)
        assert session.output_ids == expected, f"{draft_name} seed {seed} gamma {gamma}"
        stats = session.stats
        assert stats.num_emitted_tokens >= MAX_NEW_TOKENS
        if draft_name == "self-fp32":
            assert stats.acceptance_rate == 1.0  # same weights: every draft token agrees


def test_adaptive_gamma_grows_with_a_good_draft(tiny_target):
    session = run(tiny_target, ModelDrafter(tiny_target.with_precision("fp32")), prompt_for(0), gamma=2)
    assert session.controller.num_draft_tokens == 8
    assert session.stats.mean_acceptance_length > 4


def test_bad_draft_falls_back_to_target_only(tiny_target):
    session = run(tiny_target, ModelDrafter(build_tiny_llama(77)), prompt_for(0), max_new_tokens=60)
    assert session.controller.num_fallbacks >= 1
    assert session.stats.num_target_calls > session.stats.num_drafts
    assert session.output_ids == reference(tiny_target, prompt_for(0), 60)


def new_target_session(target: LoadedModel, prompt: list[int]) -> TargetSession:
    output = OutputState(tokenizer=None, eos_token_ids=frozenset(), max_new_tokens=1000)
    return TargetSession(TorchEngine(target), prompt, output=output)


def verify(session: TargetSession, draft_ids: list[int]):
    """One round at batch 1 (the whole prompt in one row)."""
    session.set_draft(draft_ids)
    return run_step(session.engine, [session])[0].verification


def test_rejected_tokens_are_rolled_back_not_recomputed(tiny_target):
    prompt = prompt_for(3, length=20)
    target_session = new_target_session(tiny_target, prompt)
    drafter = ModelDrafter(build_tiny_llama(5))
    proposal = drafter.propose(target_session.token_ids, 6, SamplingParams(), None)
    verification = verify(target_session, proposal.token_ids)
    assert target_session.num_cached == len(target_session.token_ids) - 1
    # The drafter cached prompt + 5 of its own tokens; it keeps the agreed prefix.
    drafter.propose(target_session.token_ids, 2, SamplingParams(), None)
    assert drafter._lm.cached_ids[: len(prompt) + verification.num_accepted] == (
        target_session.token_ids[: len(prompt) + verification.num_accepted]
    )


def test_chunked_prefill_gives_the_same_output(tiny_target):
    prompt = prompt_for(4, length=50)
    drafter = NgramDrafter(ngram_max=3, ngram_min=1)
    whole = run(tiny_target, drafter, prompt, chunk_size=512).output_ids
    chunked = run(tiny_target, drafter, prompt, chunk_size=7).output_ids
    assert whole == chunked == reference(tiny_target, prompt)


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_target):
    prompt = prompt_for(0)
    drafter = ModelDrafter(perturbed_copy(tiny_target, scale=0.3, seed=0))

    def sample(seed):
        return run(tiny_target, drafter, prompt, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=seed))

    first, again, other = sample(1), sample(1), sample(2)
    assert first.output_ids == again.output_ids
    assert first.output_ids != other.output_ids
    assert first.stats.num_accepted_tokens > 0


def test_max_new_tokens_is_exact_even_mid_block(tiny_target):
    for limit in (1, 2, 5, 9):
        session = run(tiny_target, ModelDrafter(tiny_target.with_precision("fp32")), prompt_for(0), max_new_tokens=limit)
        assert len(session.output_ids) == limit and session.finish_reason == "length"


def test_eos_stops_and_is_not_emitted():
    probe = build_tiny_llama(0)
    expected = reference(probe, prompt_for(0))
    eos = expected[10]
    target = build_tiny_llama(0, eos_token_id=eos)
    drafter = ModelDrafter(target.with_precision("fp32"))
    session = GenerationSession(target, drafter, prompt_for(0), GenerationOptions(max_new_tokens=40))
    while not session.finished:
        session.step()
    assert session.finish_reason == "stop"
    assert session.output_ids == expected[: expected.index(eos)]


def test_context_overflow_is_a_clear_error():
    target = build_tiny_llama(0, max_position_embeddings=32)
    with pytest.raises(ContextLengthError, match="prompt of 40 tokens"):
        new_target_session(target, prompt_for(0, length=40))
    with pytest.raises(ContextLengthError, match="max_new_tokens 30 exceeds .* context of 32 tokens"):
        GenerationSession(target, None, prompt_for(0, length=10), GenerationOptions(max_new_tokens=30))


def test_drafts_stop_at_the_context_edge():
    target = build_tiny_llama(0, max_position_embeddings=32)
    prompt = prompt_for(0, length=10)
    session = run(target, ModelDrafter(target.with_precision("fp32")), prompt, gamma=8, max_new_tokens=22)
    assert len(session.output_ids) == 22
    assert session.output_ids == reference(target, prompt, 22)


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_max_new_tokens(tiny_target, bad):
    with pytest.raises(ValueError, match=f"max_new_tokens must be an integer >= 1, got {bad}"):
        GenerationOptions(max_new_tokens=bad)


def test_generate_reports_timings_and_stats(tiny_target):
    source = DraftSource("self:fp32", tiny_target.with_precision("fp32"))
    result = generate(tiny_target, source, prompt_for(0), GenerationOptions(max_new_tokens=20, ignore_eos=True))
    payload = result.to_dict()
    assert payload["completion_tokens"] == 20 and payload["finish_reason"] == "length"
    assert 0 < payload["ttft_s"] <= payload["total_s"]
    assert payload["stats"]["acceptance_rate"] == 1.0
    assert payload["tokens_per_s"] > 0


def test_rollback_restores_the_cache_invariant(tiny_target):
    prompt = prompt_for(6)
    session = new_target_session(tiny_target, prompt)
    first = verify(session, []).next_token_id
    verify(session, [1, 2, 3])
    session.rollback(len(prompt))
    assert session.token_ids == prompt and session.num_cached == len(prompt) - 1
    assert verify(session, []).next_token_id == first


def test_hybrid_uses_lookup_when_it_matches_and_the_model_otherwise():
    from services.models.drafters.hybrid import HybridDrafter

    target = build_tiny_llama(0)
    model_draft = ModelDrafter(perturbed_copy(target, scale=0.05, seed=3))
    drafter = HybridDrafter(NgramDrafter(ngram_max=3, ngram_min=2), model_draft)
    assert drafter.propose([4, 8, 15, 16, 4, 8], 2, SamplingParams(), None).token_ids == [15, 16]  # lookup
    assert drafter.num_lookup_rounds == 1
    prompt, options = [4, 8, 15, 16, 23, 42, 4, 8], GenerationOptions(max_new_tokens=30, ignore_eos=True)
    outputs = []
    for used in (drafter, None):
        session = GenerationSession(target, used, prompt, options)
        while not session.finished:
            session.step()
        outputs.append(session.output_ids)
    assert outputs[0] == outputs[1]  # lossless whichever half drafted
    assert drafter.num_model_rounds > 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_an_int8_target_speculating_decodes_what_it_decodes_alone(seed):
    """int8 with per-token scales and attention in double (services/models/int8_linear.py): a token verified in a
    block gets the bits it gets decoded alone, so greedy speculation is the int8 target's own output."""
    target = build_tiny_llama(seed).with_precision("int8")
    prompt = prompt_for(seed)
    expected = run(target, None, prompt).output_ids
    drafter = ModelDrafter(perturbed_copy(build_tiny_llama(seed), scale=0.05, seed=seed))  # close: long blocks
    for gamma in (2, 5, 8):
        session = run(target, drafter, prompt, gamma=gamma, fixed_gamma=True)
        assert session.output_ids == expected, f"seed {seed} gamma {gamma}"
        assert session.stats.num_accepted_tokens > 0


def test_the_in_process_cost_model_drafts_then_verifies(tiny_target, tmp_path):
    """In one process a round drafts, then verifies: the model charges every draft step (no pipelined overlap,
    which a remote draft worker's model counts on)."""
    from services.engine.profile import measure_cost_model
    from services.models.drafters import load_draft_source

    cost = measure_cost_model(tiny_target, load_draft_source("synthetic:0.9@8ms", tiny_target), tmp_path)
    assert not cost.pipelined and not cost.plain_ms
    assert cost.draft_cost() == 8.0 and cost.drafting_ms(3, 1, alpha=0.9) == 3 * 8.0


PROCESSED = SamplingParams(presence_penalty=0.8, frequency_penalty=0.4, repetition_penalty=1.3,
                           logit_bias={5: 3.0, 17: -100.0}, logprobs=3)


@pytest.mark.parametrize("draft_name", ["self-fp32", "model-perturbed", "self-int8"])
def test_penalties_biases_and_logprobs_through_speculation_equal_target_only(draft_name):
    """Greedy with every penalty and a bias: the same tokens as target-only decoding with them, and each token's
    log probabilities within 1e-5 (they come from a block's forward instead of one position's)."""
    target = build_tiny_llama(1)
    prompt = prompt_for(1)
    plain = run(target, None, prompt, sampling=PROCESSED)
    assert plain.output_ids != run(target, None, prompt).output_ids  # the penalties change the answer
    assert 17 not in plain.output_ids
    drafter = DRAFTS[draft_name](target, 1)
    for gamma in (2, 5):
        session = run(target, drafter, prompt, gamma=gamma, fixed_gamma=True, sampling=PROCESSED)
        assert session.output_ids == plain.output_ids, f"{draft_name} gamma {gamma}"
        assert session.stats.num_accepted_tokens > 0
        assert len(session.logprobs.logprobs) == MAX_NEW_TOKENS
        assert session.logprobs.logprobs == pytest.approx(plain.logprobs.logprobs, abs=1e-5)
        assert session.logprobs.top_ids == plain.logprobs.top_ids
        flat = [value for row in session.logprobs.top_logprobs for value in row]
        assert flat == pytest.approx([value for row in plain.logprobs.top_logprobs for value in row], abs=1e-5)


def test_a_copy_of_the_target_drafting_under_a_bias_and_a_repetition_penalty_is_always_accepted():
    target = build_tiny_llama(2)
    prompt = prompt_for(2)
    sampling = SamplingParams(repetition_penalty=1.5, logit_bias={5: 4.0, 9: -100.0})
    plain = run(target, None, prompt, sampling=sampling)
    session = run(target, ModelDrafter(target.with_precision("fp32")), prompt, gamma=4, fixed_gamma=True,
                  sampling=sampling)
    assert session.output_ids == plain.output_ids
    assert session.stats.acceptance_rate == 1.0  # the draft processed its logits as the target did
