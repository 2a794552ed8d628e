import pytest
import torch

from services.speculative.params import SamplingParams

from services.speculative.sampling import sample_from_probs, warp_logits


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"temperature": 1.0, "top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"temperature": 1.0, "top_k": -1}, "top_k must be an integer >= 0, got -1"),
    ],
)
def test_bad_parameters_name_the_value(kwargs, message):
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert str(excinfo.value) == message


def test_temperature_scales_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    probs = warp_logits(logits, SamplingParams(temperature=0.5))
    expected = torch.softmax(logits / 0.5, dim=-1)
    torch.testing.assert_close(probs, expected)


def test_top_k_keeps_exactly_k_best():
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0, 2.5]])
    probs = warp_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.nonzero(probs[0]).flatten().tolist() == [1, 4]
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_top_p_keeps_smallest_set_reaching_p():
    base = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = base.log()
    # 0.5 < 0.7, 0.5 + 0.3 >= 0.7: keep the two best.
    probs = warp_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    # A top_p below the best token's mass still keeps the best token.
    probs = warp_logits(logits, SamplingParams(temperature=1.0, top_p=0.1))
    torch.testing.assert_close(probs, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_a_denormal_top_p_keeps_the_best_token_over_a_large_vocabulary():
    """Found by the API fuzzer: top_p=5e-324 over 49k tokens, where the cumsum's rounding left the best
    token's 'mass before' just above zero and every token was dropped (NaN probabilities)."""
    logits = torch.randn(4, 49152, generator=torch.Generator().manual_seed(0)) * 5
    probs = warp_logits(logits, SamplingParams(temperature=1.0, top_p=5e-324))
    assert not torch.isnan(probs).any()
    assert probs.argmax(-1).tolist() == logits.argmax(-1).tolist() and (probs > 0).sum(-1).tolist() == [1] * 4


def test_seeded_sampling_is_reproducible():
    probs = torch.softmax(torch.randn(4, 50), dim=-1)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = sample_from_probs(probs, params.make_generator())
    second = sample_from_probs(probs, params.make_generator())
    assert torch.equal(first, second)
    # The draft's stream (offset 1) is not the target's.
    assert params.make_generator().initial_seed() != params.make_generator(offset=1).initial_seed()


def test_a_vanishing_temperature_is_greedy_not_nan():
    assert SamplingParams(temperature=5e-324).greedy and SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=1e-3).greedy
    probs = warp_logits(torch.randn(2, 1000) * 5, SamplingParams(temperature=1e-3))
    assert not torch.isnan(probs).any()
