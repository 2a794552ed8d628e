"""The target's logits as a request's penalties and biases change them, at every position of a block, and the log
probabilities of the tokens a round commits.

Target-only decoding processes one position per step, with the tokens committed before it. A verified block holds
g + 1 positions at once: position i comes after the committed tokens and the block's first i draft tokens, so it
is processed as if those i tokens were already committed (their counts, their presence). A draft token accepted at
position i is then exactly what target-only decoding would have committed there, so greedy output is identical and
rejection sampling reproduces the processed distribution.

Order, as vLLM applies them: logit_bias, then repetition_penalty (over the prompt and the output), then
frequency_penalty and presence_penalty (over the output only); the warp (temperature, top-k, top-p: sampling.py)
comes after. Log probabilities are the target's own distribution before any of this (vLLM's default,
`raw_logprobs`), one row per committed token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from services.speculative.params import SamplingParams


def process_logits(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int],
                   draft_ids: Sequence[int], params: SamplingParams) -> torch.Tensor:
    """Logits [len(draft_ids) + 1, vocab] at a block's positions -> processed (float32, a new tensor); row i as
    target-only decoding would see it after output_ids + draft_ids[:i]."""
    num_rows, vocab_size = logits.shape
    assert num_rows == len(draft_ids) + 1, f"expected {len(draft_ids) + 1} rows, got {num_rows}"
    scores = _add_bias(logits.float().clone(), params)
    if params.repetition_penalty != 1.0:
        seen = _counts([*prompt_ids, *output_ids], draft_ids, vocab_size) > 0  # [num_rows, vocab]
        scores = _penalize_repeats(scores, seen, params.repetition_penalty)
    if params.frequency_penalty or params.presence_penalty:
        counts = _counts(output_ids, draft_ids, vocab_size)  # [num_rows, vocab]
        scores -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(scores.dtype)
    return scores


def _add_bias(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logit_bias added in place to scores [..., vocab] (ids past the vocabulary dropped)."""
    pairs = [(token_id, bias) for token_id, bias in params.logit_bias if token_id < scores.shape[-1]]
    if pairs:
        ids = torch.tensor([token_id for token_id, _ in pairs], dtype=torch.long)
        scores[..., ids] += torch.tensor([bias for _, bias in pairs], dtype=scores.dtype)
    return scores


def _penalize_repeats(scores: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty where `seen`: a positive logit divided by it, a negative one multiplied."""
    return torch.where(seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)


def _counts(token_ids: Sequence[int], draft_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    """[len(draft_ids) + 1, vocab] float32: row i counts token_ids and draft_ids[:i] (ids past the vocab dropped)."""
    kept = [token_id for token_id in token_ids if token_id < vocab_size]
    base = torch.bincount(torch.tensor(kept, dtype=torch.long), minlength=vocab_size).to(torch.float32)
    counts = base.expand(len(draft_ids) + 1, vocab_size).clone()
    for index, token_id in enumerate(draft_ids):
        if token_id < vocab_size:
            counts[index + 1:, token_id] += 1
    return counts


class DraftProcessing:
    """What a model draft can apply of a request's processing from its context alone, so that its proposals
    follow the processed target: logit_bias and repetition_penalty (the context is the prompt and the output
    both). The frequency and presence penalties count the output only, which a draft's context does not mark
    apart, so a draft goes without them (any draft is lossless; this one is only accepted more often). One per
    proposal: `apply` a row of the draft's logits, then `add` the token drafted from it."""

    def __init__(self, context_ids: Sequence[int], params: SamplingParams, vocab_size: int) -> None:
        self.params = params
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        if params.repetition_penalty != 1.0:
            self.seen[torch.tensor([t for t in context_ids if t < vocab_size], dtype=torch.long)] = True

    @staticmethod
    def needed(params: SamplingParams) -> bool:
        return params.repetition_penalty != 1.0 or bool(params.logit_bias)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """One position's logits [vocab] -> processed (float32, a new tensor), as process_logits' row would be
        without the output-only penalties."""
        scores = _add_bias(logits.float().clone(), self.params)
        penalty = self.params.repetition_penalty
        if penalty != 1.0:
            width = min(scores.shape[-1], self.seen.shape[0])
            scores[:width] = _penalize_repeats(scores[:width], self.seen[:width], penalty)
        return scores

    def add(self, token_id: int) -> None:
        if token_id < self.seen.shape[0]:
            self.seen[token_id] = True


@dataclass
class TokenLogprobs:
    """Per token: its log probability, and the `top` most likely ids with theirs (best first)."""

    logprobs: list[float] = field(default_factory=list)
    top_ids: list[list[int]] = field(default_factory=list)
    top_logprobs: list[list[float]] = field(default_factory=list)

    def head(self, count: int) -> "TokenLogprobs":
        """The first `count` tokens' entries."""
        return TokenLogprobs(self.logprobs[:count], self.top_ids[:count], self.top_logprobs[:count])

    def extend(self, other: "TokenLogprobs") -> None:
        self.logprobs += other.logprobs
        self.top_ids += other.top_ids
        self.top_logprobs += other.top_logprobs


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], top: int) -> TokenLogprobs:
    """Row i of logits [>= len(token_ids), vocab] is the distribution token_ids[i] was chosen from."""
    rows = logits[: len(token_ids)].float().log_softmax(dim=-1)  # [num_tokens, vocab]
    chosen = rows.gather(-1, torch.tensor(token_ids, dtype=torch.long)[:, None]).squeeze(-1)
    if top:
        values, ids = rows.topk(top, dim=-1)
        return TokenLogprobs(chosen.tolist(), ids.tolist(), values.tolist())
    return TokenLogprobs(chosen.tolist(), [[] for _ in token_ids], [[] for _ in token_ids])
