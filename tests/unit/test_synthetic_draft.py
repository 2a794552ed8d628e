"""The synthetic drafter: a chosen acceptance, labelled, never passed off as a real draft."""

import pytest

from services.models.drafters.synthetic import ReferenceBook, SyntheticDrafter, parse_synthetic_acceptance
from services.speculative.sampling import SamplingParams


def test_parse_acceptance():
    assert parse_synthetic_acceptance("synthetic:0.7") == 0.7
    with pytest.raises(ValueError, match="'abc' is not a number"):
        parse_synthetic_acceptance("synthetic:abc")
    with pytest.raises(ValueError, match="outside"):
        parse_synthetic_acceptance("synthetic:1.5")


@pytest.mark.parametrize("acceptance", [0.0, 0.3, 0.7, 1.0])
def test_first_position_is_right_with_the_chosen_probability(acceptance):
    prompt, output = [1, 2, 3], list(range(10, 4010))
    book = ReferenceBook()
    book.add(prompt, output)
    drafter = SyntheticDrafter(acceptance, book, vocab_size=5000, seed=1)
    hits, rounds = 0, 2000
    for step in range(rounds):
        proposal = drafter.propose([*prompt, *output[:step]], 3, SamplingParams(), None)
        assert len(proposal.token_ids) == 3 and proposal.probs is None
        hits += proposal.token_ids[0] == output[step]
        assert all(t == output[step + i] or t == (output[step + i] + 1) % 5000
                   for i, t in enumerate(proposal.token_ids))
    assert hits / rounds == pytest.approx(acceptance, abs=0.04)


def test_proposals_stop_at_the_end_of_the_reference_and_need_one():
    book = ReferenceBook()
    book.add([5, 6], [7, 8])
    drafter = SyntheticDrafter(1.0, book, vocab_size=10)
    assert drafter.propose([5, 6, 7], 4, SamplingParams(), None).token_ids == [8]
    assert drafter.propose([5, 6, 7, 8], 4, SamplingParams(), None).token_ids == []
    stranger = SyntheticDrafter(1.0, book, vocab_size=10)
    with pytest.raises(ValueError, match="no reference run"):
        stranger.propose([1, 2], 2, SamplingParams(), None)
