"""The synthetic drafter: a chosen acceptance, labelled, never passed off as a real draft."""

import pytest

from services.models.drafters.synthetic import SyntheticDrafter
from services.models.synthetic_spec import ReferenceBook, SyntheticSpec, parse_synthetic_spec
from services.models.random_spec import parse_random_spec
from services.speculative.params import SamplingParams
from services.synthetic import describe_label, synthetic_label, worker_synthetic


def test_parse_acceptance_and_cost():
    assert parse_synthetic_spec("synthetic:0.7") == SyntheticSpec(0.7, 0.0)
    assert parse_synthetic_spec("synthetic:0.9@8ms") == SyntheticSpec(0.9, 8.0)
    assert parse_synthetic_spec("synthetic:1@0.5ms") == SyntheticSpec(1.0, 0.5)
    assert parse_synthetic_spec("synthetic:0.9@8ms").name == "synthetic:0.9@8ms"
    assert parse_synthetic_spec("synthetic:0.70").name == "synthetic:0.7"


@pytest.mark.parametrize(("spec", "message"), [
    ("synthetic:abc", "acceptance 'abc' is not a number"),
    ("synthetic:", "acceptance '' is not a number"),
    ("synthetic:1.5", "acceptance '1.5' is outside"),
    ("synthetic:0.9@8", "cost '8' must be milliseconds"),
    ("synthetic:0.9@8s", "cost '8s' must be milliseconds"),
    ("synthetic:0.9@fastms", "cost 'fastms' must be milliseconds"),
    ("synthetic:0.9@-1ms", "cost '-1ms' is outside"),
    ("synthetic:0.9@", "cost '' must be milliseconds"),
    ("random:huge", "unknown shape 'huge'"),  # the target's half of a synthetic stack (random_shapes.py)
    ("random:", "unknown shape ''"),
    ("random:tiny:x", "seed 'x' must be a whole number"),
    ("random:tiny:-1", "seed '-1' must be a whole number"),
])
def test_bad_specs_name_the_bad_value(spec, message):
    parse = parse_random_spec if spec.startswith("random:") else parse_synthetic_spec
    with pytest.raises(ValueError, match=message) as caught:
        parse(spec)
    assert repr(spec) in str(caught.value)


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


def test_the_cost_is_slept_per_proposed_token_and_decisions_do_not_depend_on_who_asks():
    book = ReferenceBook()
    book.add([1, 2], list(range(3, 40)))
    slept = []
    drafter = SyntheticDrafter(parse_synthetic_spec("synthetic:0.5@8ms"), book, vocab_size=64, sleep=slept.append)
    first = drafter.propose([1, 2, 3], 5, SamplingParams(), None).token_ids
    assert slept == [pytest.approx(0.040)]
    # a speculation drafting the same positions again, in other pieces, proposes the same tokens
    again = SyntheticDrafter(parse_synthetic_spec("synthetic:0.5@8ms"), book, vocab_size=64, sleep=slept.append)
    assert again.propose([1, 2, 3], 2, SamplingParams(), None).token_ids + \
        again.propose([1, 2, 3, 4, 5], 3, SamplingParams(), None).token_ids == first
    assert drafter.propose(list(range(1, 40)), 4, SamplingParams(), None).token_ids == []
    assert len(slept) == 3  # nothing proposed, nothing slept


def test_a_serving_book_fetches_on_a_miss_and_an_unknown_prompt_drafts_nothing():
    published = []
    book = ReferenceBook(fetch=lambda: list(published))
    unknown = SyntheticDrafter(1.0, book, vocab_size=10, required=False)
    assert unknown.propose([5, 6], 3, SamplingParams(), None).token_ids == []
    published.append(([5, 6], [7, 8, 9]))
    known = SyntheticDrafter(1.0, book, vocab_size=10, required=False)
    assert known.propose([5, 6], 3, SamplingParams(), None).token_ids == [7, 8, 9]


def test_a_later_turn_finds_its_own_reference_not_the_first_turns():
    """Turn 2's prompt starts with turn 1's; turn 1's reference ends before turn 2's context does."""
    published = [([5, 6], [7, 8])]
    book = ReferenceBook(fetch=lambda: list(published))
    assert SyntheticDrafter(1.0, book, vocab_size=20).propose([5, 6], 2, SamplingParams(), None).token_ids == [7, 8]
    published.append(([5, 6, 7, 8, 9], [10, 11]))  # turn 2: turn 1, its answer, the next user turn
    turn2 = SyntheticDrafter(1.0, book, vocab_size=20)
    assert turn2.propose([5, 6, 7, 8, 9], 3, SamplingParams(), None).token_ids == [10, 11]  # fetched on the miss
    book.add([5], [6, 7, 8, 9, 12])  # a shorter prompt that also starts the context: the longest prompt wins
    assert book.find([5, 6, 7, 8, 9]) == [5, 6, 7, 8, 9, 10, 11]


def test_labels_say_what_is_synthetic():
    assert synthetic_label("smollm2-135m", "auto") is None
    label = synthetic_label("random:llama-1b", "synthetic:0.9@8ms")
    assert label["synthetic"] is True
    assert "random weights" in label["target"] and "chosen, not earned" in label["draft"]
    assert "8 ms per draft token" in label["draft"]
    assert describe_label(label).startswith("SYNTHETIC: ")
    assert synthetic_label("smollm2-135m", "synthetic:0.7") == {
        "synthetic": True, "draft": "synthetic:0.7: acceptance 0.7 chosen, not earned; 0 ms per draft token "
        "modeled by a sleep"}
    assert worker_synthetic("smollm2-135m") is None
    assert "random weights" in worker_synthetic("random-tiny")
    assert "chosen" in worker_synthetic("random-tiny", "synthetic:0.9@8ms")
