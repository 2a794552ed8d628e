"""Penalties, biases and log probabilities over a verified block (services/speculative/processing.py): each
position processed exactly as token-by-token decoding would, and sampling through a block with penalties draws
from the penalized distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import RepetitionPenaltyLogitsProcessor

from services.speculative.params import SamplingParams
from services.speculative.processing import process_logits, token_logprobs
from services.speculative.verification import verify_block

VOCAB = 50
ALL_ON = SamplingParams(presence_penalty=0.7, frequency_penalty=0.3, repetition_penalty=1.4,
                        logit_bias={3: 5.0, 11: -100.0, 49: 0.5})


def one_position(row: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams) -> torch.Tensor:
    """Token-by-token decoding's processing of one position, written out token by token."""
    scores = row.float().clone()
    for token_id, bias in params.logit_bias:
        scores[token_id] += bias
    for token_id in set(prompt) | set(output):
        value = scores[token_id]
        scores[token_id] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token_id in set(output):
        count = output.count(token_id)
        scores[token_id] -= params.frequency_penalty * count + params.presence_penalty
    return scores


@pytest.mark.parametrize("seed", range(5))
def test_each_position_of_a_block_sees_the_drafts_before_it_as_committed(seed):
    generator = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, VOCAB, (12,), generator=generator).tolist()
    output = torch.randint(0, VOCAB, (6,), generator=generator).tolist()
    draft = [output[0], output[0], prompt[1], 7, 7]  # repeats within the block and with what came before
    logits = torch.randn(len(draft) + 1, VOCAB, generator=generator) * 3
    processed = process_logits(logits, prompt, output, draft, ALL_ON)
    for index in range(len(draft) + 1):
        expected = one_position(logits[index], prompt, output + draft[:index], ALL_ON)
        torch.testing.assert_close(processed[index], expected, rtol=0, atol=1e-6)
    assert not torch.equal(processed, logits)  # it did something


def test_the_repetition_penalty_is_transformers_own():
    generator = torch.Generator().manual_seed(3)
    context = torch.randint(0, VOCAB, (20,), generator=generator).tolist()
    draft = [5, 9, 5]
    logits = torch.randn(len(draft) + 1, VOCAB, generator=generator)
    params = SamplingParams(repetition_penalty=1.7)
    processed = process_logits(logits, context[:15], context[15:], draft, params)
    reference = RepetitionPenaltyLogitsProcessor(penalty=1.7)
    for index in range(len(draft) + 1):
        ids = torch.tensor([context + draft[:index]])
        torch.testing.assert_close(processed[index], reference(ids, logits[index:index + 1].clone())[0])


def test_off_by_default_and_ids_past_the_logits_are_dropped():
    assert not SamplingParams().processes_logits and not SamplingParams(logprobs=5).processes_logits
    logits = torch.randn(2, VOCAB)
    params = SamplingParams(logit_bias={VOCAB + 3: 10.0, 1: 2.0}, presence_penalty=1.0)
    processed = process_logits(logits, [VOCAB + 1], [VOCAB + 2, 4], [VOCAB + 9], params)
    expected = logits.clone()
    expected[:, 1] += 2.0
    expected[:, 4] -= 1.0
    torch.testing.assert_close(processed, expected)


def test_greedy_verification_under_a_ban_rejects_the_banned_draft_token():
    logits = torch.zeros(3, VOCAB)
    logits[:, 8] = 5.0  # the target's best everywhere
    logits[:, 9] = 4.0
    params = SamplingParams(logit_bias={8: -100.0})
    processed = process_logits(logits, [1], [], [8, 9], params)
    verdict = verify_block([8, 9], None, processed, params, None)
    assert (verdict.num_accepted, verdict.next_token_id) == (0, 9)


def test_a_presence_penalty_counts_an_accepted_draft_token_for_the_next_position():
    logits = torch.zeros(3, VOCAB)
    logits[:, 8] = 1.0  # 8 wins each position on its own ...
    logits[:, 9] = 0.5
    params = SamplingParams(presence_penalty=1.0)  # ... but once 8 is out, 9 wins
    processed = process_logits(logits, [1], [], [8, 8], params)
    verdict = verify_block([8, 8], None, processed, params, None)
    assert (verdict.num_accepted, verdict.next_token_id) == (1, 9)


def test_sampling_through_blocks_with_penalties_draws_the_penalized_pair():
    """Rounds of 2-token model drafts, verified with a presence and frequency penalty and a bias: the first two
    tokens follow p(x1) p(x2 | x1), each processed as token-by-token decoding would."""
    vocab, trials = 3, 3000
    torch.manual_seed(11)
    rows = torch.randn(4, vocab)  # the target's logits at output positions 0..3 (context-free, for the test)
    draft = torch.softmax(torch.randn(vocab), -1)
    params = SamplingParams(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.4, logit_bias={2: 0.8})
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(vocab, vocab)
    for _ in range(trials):
        output: list[int] = []
        while len(output) < 2:
            block = torch.multinomial(draft, 2, replacement=True, generator=generator).tolist()
            position = len(output)
            processed = process_logits(rows[position:position + 3], [0], output, block, params)
            verdict = verify_block(block, draft.expand(2, vocab), processed, params, generator)
            output += [*block[:verdict.num_accepted], verdict.next_token_id]
        counts[output[0], output[1]] += 1
    first = torch.softmax(one_position(rows[0], [0], [], params), -1)
    second = torch.stack([torch.softmax(one_position(rows[1], [0], [x1], params), -1) for x1 in range(vocab)])
    expected = first[:, None] * second * trials
    assert chisquare(counts.flatten().numpy(), expected.flatten().numpy()).pvalue > 1e-3
    plain = torch.softmax(rows[0], -1)[:, None] * torch.softmax(rows[1], -1)[None, :] * trials
    assert chisquare(counts.flatten().numpy(), plain.flatten().numpy()).pvalue < 1e-6  # the penalty mattered


def test_log_probabilities_of_the_committed_tokens_and_the_best_alternatives():
    logits = torch.randn(4, VOCAB)
    found = token_logprobs(logits, [5, 6, 7], 3)
    reference = logits.log_softmax(-1)
    assert found.logprobs == pytest.approx([reference[i, t].item() for i, t in enumerate([5, 6, 7])], abs=1e-6)
    for row in range(3):
        values, ids = reference[row].topk(3)
        assert found.top_ids[row] == ids.tolist() and found.top_logprobs[row] == pytest.approx(values.tolist())
    assert token_logprobs(logits, [1], 0).top_ids == [[]]
    assert found.head(2).logprobs == found.logprobs[:2]


def test_bad_values_are_refused_naming_the_field():
    for kwargs, name in [({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": "x"},
                         "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
                         ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {1: 200}}, "logit_bias"),
                         ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs")]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kwargs)


def test_a_draft_applies_what_its_context_alone_decides_as_the_target_would():
    from services.speculative.processing import DraftProcessing

    generator = torch.Generator().manual_seed(8)
    context = torch.randint(0, VOCAB, (15,), generator=generator).tolist()
    params = SamplingParams(repetition_penalty=1.6, logit_bias={3: 2.0, 4: -100.0})
    rows = torch.randn(3, VOCAB, generator=generator)
    draft = DraftProcessing(context, params, VOCAB)
    drafted = [9, 3]
    target = process_logits(rows, context[:10], context[10:], drafted, params)  # no output-only penalty here
    for index in range(3):
        torch.testing.assert_close(draft.apply(rows[index]), target[index])
        if index < len(drafted):
            draft.add(drafted[index])
    assert DraftProcessing.needed(params) and not DraftProcessing.needed(SamplingParams(presence_penalty=1.0))
