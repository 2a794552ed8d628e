import pytest
import torch

from services.speculative.sampling import SamplingParams, sample_from_probs, warp_logits


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


def test_seeded_sampling_is_reproducible():
    probs = torch.softmax(torch.randn(4, 50), dim=-1)
    params = SamplingParams(temperature=1.0, seed=1234)
    first = sample_from_probs(probs, params.make_generator())
    second = sample_from_probs(probs, params.make_generator())
    assert torch.equal(first, second)
    # The draft's stream (offset 1) is not the target's.
    assert params.make_generator().initial_seed() != params.make_generator(offset=1).initial_seed()
