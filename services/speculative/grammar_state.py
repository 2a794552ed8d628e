"""One session's grammar state, in step with its committed output, and the masks it puts on the target's logits
at a block's positions (services/engine/target.py applies them; grammar.py has the grammar text)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from services.speculative.grammar import GrammarError, llguidance, vocabulary


class GrammarState:
    """One session's grammar, in step with its committed output."""

    def __init__(self, grammar: str, tokenizer: object, vocab_size: int, eos_ids: Sequence[int],
                 output_ids: Sequence[int] = ()) -> None:
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._matcher = llguidance().LLMatcher(vocabulary(tokenizer, vocab_size, tuple(self.eos_ids)), grammar)
        self._check()
        self.num_consumed = 0  # output tokens fed to the matcher (those up to the grammar's end)
        self.commit(output_ids)

    def _check(self) -> None:
        if self._matcher.is_error():
            raise GrammarError(self._matcher.get_error())

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of the tokens, from the first, the grammar allows next."""
        return self._matcher.validate_tokens(list(token_ids)) if token_ids else 0

    def forced(self, after: Sequence[int] = ()) -> list[int]:
        """The tokens the grammar forces next (none where it leaves a choice), after the committed output and
        then `after` (valid tokens: valid_prefix)."""
        consumed = sum(self._consume(token_id) for token_id in after)
        forced = [] if self._matcher.is_stopped() else list(self._matcher.compute_ff_tokens())
        self._unfeed(consumed)
        return forced

    def _allowed(self) -> torch.Tensor:
        """The tokens allowed next; once the grammar is complete, the end of the answer (any of the target's end
        tokens, as the output's stopping rules count them)."""
        if not self._matcher.is_stopped():
            bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = torch.from_numpy(bits[: self.vocab_size].astype(bool))
            if allowed.any():
                return allowed
        allowed = torch.zeros(self.vocab_size, dtype=torch.bool)
        allowed[self.eos_ids] = True
        return allowed

    def masks(self, draft_ids: Sequence[int]) -> torch.Tensor:
        """[len(draft_ids) + 1, vocab] bool: what the grammar allows after the committed output and the block's
        first i tokens (the draft must be valid: valid_prefix)."""
        rows, consumed = [], 0
        for index in range(len(draft_ids) + 1):
            rows.append(self._allowed())
            if index < len(draft_ids) and self._consume(draft_ids[index]):
                consumed += 1
        self._unfeed(consumed)
        return torch.stack(rows)

    def _unfeed(self, num_tokens: int) -> None:
        """Take back the last num_tokens fed (a block's, a draft's: never committed)."""
        self._matcher.rollback(num_tokens)
        self._check()

    def _consume(self, token_id: int) -> bool:
        """Feed one token; none once the grammar is complete (what follows is the end of the answer)."""
        if self._matcher.is_stopped():
            return False
        self._matcher.consume_token(token_id)
        return True

    def drafting(self, context_ids: Sequence[int], num_committed: int) -> "DraftMasks | None":
        """Masks for a model draft proposing after context_ids, whose first num_committed tokens are what this
        state has seen (a pipelined draft reads further: those tokens are fed first); None where they break
        the grammar (the draft then goes unmasked: any draft is lossless)."""
        ahead = list(context_ids[num_committed:])
        if len(context_ids) < num_committed or self.valid_prefix(ahead) < len(ahead):
            return None
        return DraftMasks(self, ahead)

    def commit(self, token_ids: Sequence[int]) -> None:
        self.num_consumed += sum(self._consume(token_id) for token_id in token_ids)
        self._check()

    def rollback(self, output_ids: Sequence[int]) -> None:
        """Back to the state after `output_ids`, a prefix of what was committed."""
        remaining = len(output_ids)
        if self.num_consumed <= remaining:  # tokens past the grammar's end were never fed
            return
        self._matcher.rollback(self.num_consumed - remaining)
        self.num_consumed = remaining
        self._check()

    @property
    def finished(self) -> bool:
        """Nothing but the end of the answer is allowed."""
        return self._matcher.is_stopped()


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Logits [n, vocab] with every token the grammar forbids at -inf (columns past `allowed` too)."""
    width = min(logits.shape[-1], allowed.shape[-1])
    masked = torch.full_like(logits, float("-inf"))
    masked[:, :width] = torch.where(allowed[:, :width], logits[:, :width], masked[:, :width])
    return masked


class DraftMasks:
    """A model draft's view of the grammar while it proposes one block: allowed() before each token, push() each
    token drafted, close() when done (the grammar state is back where it was)."""

    def __init__(self, state: GrammarState, ahead: Sequence[int]) -> None:
        self.state = state
        self.fed = sum(state._consume(token_id) for token_id in ahead)

    def allowed(self) -> torch.Tensor:
        return self.state._allowed()

    def push(self, token_id: int) -> None:
        if self.state.valid_prefix([token_id]) == 1:  # a forbidden token would put the matcher in error for good
            self.fed += self.state._consume(token_id)

    def close(self) -> None:
        self.state._unfeed(self.fed)
        self.fed = 0
