"""Exact cases with +-100 logits (greedy certain), and statistical tests that sampling is lossless."""

import pytest
import torch
from scipy.stats import chisquare

from services.speculative.params import SamplingParams

from services.speculative.sampling import warp_logits
from services.speculative.verification import greedy_verify, rejection_sample

VOCAB = 8


def certain_logits(token_ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    """[len(token_ids), vocab]: +100 on the given token, -100 elsewhere."""
    logits = torch.full((len(token_ids), vocab), -100.0)
    logits[torch.arange(len(token_ids)), torch.tensor(token_ids)] = 100.0
    return logits


def certain_probs(token_ids: list[int], vocab: int = VOCAB) -> torch.Tensor:
    return torch.softmax(certain_logits(token_ids, vocab), dim=-1)


@pytest.mark.parametrize(
    "draft, target, num_accepted, next_token",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),  # all accepted: bonus
        ([1, 2, 3], [5, 2, 3, 4], 0, 5),  # first rejected: recovered
        ([1, 2, 3], [1, 6, 3, 4], 1, 6),  # middle rejected
        ([1, 2, 3], [1, 2, 7, 4], 2, 7),  # last rejected
        ([], [4], 0, 4),  # no draft: plain target step
    ],
)
def test_greedy_exact(draft, target, num_accepted, next_token):
    result = greedy_verify(torch.tensor(draft, dtype=torch.long), certain_logits(target))
    assert (result.num_accepted, result.next_token_id) == (num_accepted, next_token)
    assert result.is_bonus == (num_accepted == len(draft))


@pytest.mark.parametrize(
    "draft, target, num_accepted, next_token",
    [
        ([1, 2, 3], [1, 2, 3, 4], 3, 4),
        ([1, 2, 3], [5, 2, 3, 4], 0, 5),
        ([1, 2, 3], [1, 6, 3, 4], 1, 6),
    ],
)
@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampler_exact(draft, target, num_accepted, next_token, point_mass):
    draft_probs = None if point_mass else certain_probs(draft)
    generator = torch.Generator().manual_seed(0)
    result = rejection_sample(torch.tensor(draft), draft_probs, certain_probs(target), generator)
    assert (result.num_accepted, result.next_token_id) == (num_accepted, next_token)


def _first_token_counts(draft_probs, target_probs, num_trials, seed, point_mass=False):
    """Counts of the first emitted token over many single-token rounds."""
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(target_probs.shape[-1])
    draft_ids = torch.multinomial(draft_probs.expand(num_trials, -1), 1, replacement=True, generator=generator)
    for trial in range(num_trials):
        draft_id = draft_ids[trial]
        result = rejection_sample(
            draft_id, None if point_mass else draft_probs[None], target_probs.expand(2, -1), generator
        )
        counts[draft_id.item() if result.num_accepted else result.next_token_id] += 1
    return counts


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=3),
        SamplingParams(temperature=1.3, top_p=0.8),
    ],
    ids=["temperature-1", "top-k", "top-p"],
)
def test_sampling_reproduces_target_distribution(params):
    torch.manual_seed(7)
    target_logits = torch.randn(1, 6) * 1.5
    draft_logits = torch.randn(1, 6) * 1.5  # a different distribution
    target_probs = warp_logits(target_logits, params)[0]
    draft_probs = warp_logits(draft_logits, params)[0]
    num_trials = 6000
    counts = _first_token_counts(draft_probs, target_probs, num_trials, seed=11)
    support = target_probs > 0
    assert counts[~support].sum() == 0, "emitted a token the warped target excludes"
    expected = target_probs[support] * num_trials
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3
    # The draft alone is far from the target: the test can tell them apart.
    draft_expected = draft_probs[support] * num_trials
    if (draft_probs[support] > 0).all():
        draft_expected = draft_expected / draft_expected.sum() * num_trials
        assert chisquare(counts[support].numpy(), draft_expected.numpy()).pvalue < 1e-6


def test_point_mass_draft_reproduces_target_distribution():
    target_probs = torch.tensor([0.1, 0.5, 0.25, 0.15])
    draft_probs = torch.tensor([0.7, 0.1, 0.1, 0.1])  # where the n-gram guesses come from
    num_trials = 6000
    counts = _first_token_counts(draft_probs, target_probs, num_trials, seed=3, point_mass=True)
    assert chisquare(counts.numpy(), (target_probs * num_trials).numpy()).pvalue > 1e-3


def test_two_token_joint_distribution():
    """With gamma 2 the pair of emitted tokens follows p_target(x1) p_target(x2 | x1)."""
    vocab = 3
    torch.manual_seed(5)
    target_first = torch.softmax(torch.randn(vocab), -1)
    target_second = torch.softmax(torch.randn(vocab, vocab), -1)  # row = x1
    draft_first = torch.softmax(torch.randn(vocab), -1)
    draft_second = torch.softmax(torch.randn(vocab, vocab), -1)
    target_third = torch.softmax(torch.randn(vocab), -1)  # bonus row, unused by the pair
    generator = torch.Generator().manual_seed(9)
    num_trials = 9000
    counts = torch.zeros(vocab, vocab)
    for _ in range(num_trials):
        d1 = torch.multinomial(draft_first, 1, generator=generator)
        d2 = torch.multinomial(draft_second[d1.item()], 1, generator=generator)
        draft_ids = torch.cat([d1, d2])
        draft_probs = torch.stack([draft_first, draft_second[d1.item()]])
        target_probs = torch.stack([target_first, target_second[d1.item()], target_third])
        result = rejection_sample(draft_ids, draft_probs, target_probs, generator)
        x1 = d1.item() if result.num_accepted >= 1 else result.next_token_id
        if result.num_accepted == 0:
            # The round stopped after x1: draw x2 from the target as the next round would.
            x2 = torch.multinomial(target_second[x1], 1, generator=generator).item()
        elif result.num_accepted == 1:
            x2 = result.next_token_id
        else:
            x2 = d2.item()
        counts[x1, x2] += 1
    expected = target_first[:, None] * target_second * num_trials
    assert chisquare(counts.flatten().numpy(), expected.flatten().numpy()).pvalue > 1e-3


def test_seeded_rejection_sampling_is_deterministic():
    torch.manual_seed(1)
    target_probs = torch.softmax(torch.randn(5, 20), -1)
    draft_probs = torch.softmax(torch.randn(4, 20), -1)
    draft_ids = torch.multinomial(draft_probs, 1).squeeze(-1)
    runs = [
        [rejection_sample(draft_ids, draft_probs, target_probs, generator) for _ in range(20)]
        for generator in (torch.Generator().manual_seed(42), torch.Generator().manual_seed(42))
    ]
    assert runs[0] == runs[1]
    assert len({(r.num_accepted, r.next_token_id) for r in runs[0]}) > 1  # it is random at all


def test_shape_mismatch_is_an_assertion():
    with pytest.raises(AssertionError):
        greedy_verify(torch.tensor([1, 2]), certain_logits([1, 2]))
