import torch

from services.models.drafters.ngram import NgramDrafter, find_ngram_continuation
from services.speculative.params import SamplingParams


def continuation(context, num, ngram_max=3, ngram_min=1):
    return find_ngram_continuation(torch.tensor(context), num, ngram_max, ngram_min)


def test_longest_ngram_wins():
    # The 1-gram [3] last occurred before 9; the 2-gram [2, 3] before 4, 5.
    context = [1, 2, 3, 4, 5, 6, 3, 9, 8, 2, 3]
    assert continuation(context, 2) == [4, 5]


def test_most_recent_full_match_preferred():
    context = [7, 8, 1, 1, 7, 8, 2, 2, 0, 7, 8]
    assert continuation(context, 2) == [2, 2]


def test_falls_back_to_earliest_when_recent_match_is_short():
    context = [5, 6, 1, 2, 3, 5, 6, 4, 5, 6]
    # [5, 6] at 5 has [4] then [5, 6] after it (3 tokens); at 0 it has [1, 2, 3, 5...].
    assert continuation(context, 4, ngram_max=2, ngram_min=2) == [1, 2, 3, 5]


def test_no_match_proposes_nothing():
    assert continuation([1, 2, 3, 4], 3, ngram_min=2) == []


def test_drafter_returns_point_mass():
    drafter = NgramDrafter(ngram_max=2, ngram_min=1)
    proposal = drafter.propose([1, 2, 3, 1, 2], 3, SamplingParams(), None)
    assert proposal.token_ids == [3, 1, 2]
    assert proposal.probs is None
    assert drafter.propose([1, 2, 3, 1, 2], 0, SamplingParams(), None).token_ids == []
