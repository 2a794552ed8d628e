"""One request's decoding loop: draft a block, verify it, adapt gamma, apply stops.

`step()` runs one round, so the distributed workers can drive the same
pieces (drafter.propose on the draft side, TargetSession.verify on the
verify side) from their own loops.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.config import SpeculativeSettings
from services.engine.stopping import StopStrings
from services.engine.target import TargetSession, check_prompt_fits
from services.errors import ContextLengthError
from services.models.drafters.base import DraftProposal, Drafter
from services.models.loading import LoadedModel
from services.speculative.block_length import BlockLengthController
from services.speculative.sampling import SamplingParams
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)

_NO_DRAFT = DraftProposal([], None)


class GenerationSession:
    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None,
        prompt_ids: Sequence[int],
        *,
        sampling: SamplingParams | None = None,
        max_new_tokens: int = 128,
        stop: Sequence[str] = (),
        speculative: SpeculativeSettings | None = None,
        num_draft_tokens: int | None = None,
        ignore_eos: bool = False,
        chunk_size: int = 512,
    ) -> None:
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        check_prompt_fits(target, prompt_ids)
        if len(prompt_ids) + max_new_tokens > target.max_context:
            raise ContextLengthError(
                f"prompt of {len(prompt_ids)} tokens + max_new_tokens {max_new_tokens} exceeds "
                f"{target.name!r}'s context of {target.max_context} tokens"
            )
        self.target = target
        self.drafter = drafter
        self.sampling = sampling or SamplingParams()
        self.max_new_tokens = max_new_tokens
        self.stop_strings = StopStrings(target.tokenizer, stop)
        self.eos_token_ids = frozenset() if ignore_eos else target.eos_token_ids
        self.controller = BlockLengthController(speculative or SpeculativeSettings(), num_draft_tokens)
        self.stats = SpecDecodingStats()
        self.prompt_ids = list(prompt_ids)
        self.output_ids: list[int] = []
        self.finish_reason: str | None = None
        self._target_generator = self.sampling.make_generator(offset=0, device=target.device)
        self._draft_generator = self.sampling.make_generator(offset=1, device=target.device)
        self.target_session = TargetSession(target, prompt_ids, chunk_size=chunk_size)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _block_length(self) -> int:
        if self.drafter is None:
            return 0
        remaining = self.max_new_tokens - len(self.output_ids)
        # A round emits up to gamma + 1 tokens: never draft past the token limit.
        return max(0, min(self.controller.num_draft_tokens, remaining - 1, self.target_session.room))

    def step(self) -> list[int]:
        """Run one round; return the tokens it added to the output (maybe none, at EOS)."""
        assert not self.finished, "session already finished"
        num_draft_tokens = self._block_length()
        proposal = _NO_DRAFT
        if num_draft_tokens > 0:
            proposal = self.drafter.propose(
                self.target_session.token_ids, num_draft_tokens, self.sampling, self._draft_generator
            )
        verification = self.target_session.verify(
            proposal.token_ids, proposal.probs, self.sampling, self._target_generator
        )
        self.stats.observe(verification.num_draft_tokens, verification.num_accepted)
        self.controller.update(verification.num_draft_tokens, verification.num_accepted)
        committed = [*proposal.token_ids[: verification.num_accepted], verification.next_token_id]
        return self._emit(committed)

    def _emit(self, committed: list[int]) -> list[int]:
        emitted: list[int] = []
        for token_id in committed:
            if token_id in self.eos_token_ids:
                self.finish_reason = "stop"
                break
            self.output_ids.append(token_id)
            emitted.append(token_id)
            if self.stop_strings.hit(self.output_ids):
                self.finish_reason = "stop"
                break
            if len(self.output_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
                break
        if self.finished:
            self.release()
        return emitted

    def text(self) -> str:
        tokenizer = self.target.tokenizer
        if tokenizer is None:
            return ""
        return self.stop_strings.truncate(tokenizer.decode(self.output_ids, skip_special_tokens=True))

    def release(self) -> None:
        self.target_session.release()
        if self.drafter is not None:
            self.drafter.release()
