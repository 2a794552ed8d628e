"""One request's decoding loop: draft a block, verify it, adapt gamma, apply stops.

`step()` runs one round, so the distributed workers can drive the same
pieces (drafter.propose on the draft side, TargetSession.verify on the
verify side) from their own loops.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from services.engine.options import GenerationOptions
from services.engine.stopping import OutputState
from services.engine.target import TargetSession, check_request_fits
from services.models.drafters.base import DraftProposal, Drafter
from services.models.loading import LoadedModel
from services.speculative.block_length import BlockLengthController
from services.speculative.stats import SpecDecodingStats

logger = logging.getLogger(__name__)

_NO_DRAFT = DraftProposal([], None)


class GenerationSession:
    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None,
        prompt_ids: Sequence[int],
        options: GenerationOptions | None = None,
    ) -> None:
        options = options or GenerationOptions()
        check_request_fits(target.name, target.max_context, len(prompt_ids), options.max_new_tokens)
        self.target = target
        self.drafter = drafter
        self.sampling = options.sampling
        self.output = OutputState(
            tokenizer=target.tokenizer,
            eos_token_ids=frozenset() if options.ignore_eos else target.eos_token_ids,
            max_new_tokens=options.max_new_tokens,
            stop=options.stop,
        )
        cost = options.cost if options.speculative.block_policy == "cost" else None
        self.controller = BlockLengthController(options.speculative, options.num_draft_tokens, cost)
        self.stats = SpecDecodingStats()
        self.draft_s = 0.0  # wall time in drafter.propose
        self.verify_s = 0.0  # wall time in the target's verify (prefill included)
        self.prompt_ids = list(prompt_ids)
        self._target_generator = self.sampling.make_generator(offset=0, device=target.device)
        self._draft_generator = self.sampling.make_generator(offset=1, device=target.device)
        self.target_session = TargetSession(target, prompt_ids, chunk_size=options.chunk_size)

    @property
    def finished(self) -> bool:
        return self.output.finished

    @property
    def finish_reason(self) -> str | None:
        return self.output.finish_reason

    @property
    def output_ids(self) -> list[int]:
        return self.output.output_ids

    def _block_length(self) -> int:
        if self.drafter is None:
            return 0
        # A round emits up to gamma + 1 tokens: never draft past the token limit.
        return max(0, min(self.controller.num_draft_tokens, self.output.remaining - 1, self.target_session.room))

    def step(self) -> list[int]:
        """Run one round; return the tokens it added to the output (maybe none, at EOS)."""
        assert not self.finished, "session already finished"
        num_draft_tokens = self._block_length()
        proposal = _NO_DRAFT
        started = time.perf_counter()
        if num_draft_tokens > 0:
            proposal = self.drafter.propose(
                self.target_session.token_ids, num_draft_tokens, self.sampling, self._draft_generator
            )
        drafted = time.perf_counter()
        verification = self.target_session.verify(
            proposal.token_ids, proposal.probs, self.sampling, self._target_generator
        )
        self.draft_s += drafted - started
        self.verify_s += time.perf_counter() - drafted
        self.stats.observe(verification.num_draft_tokens, verification.num_accepted)
        self.controller.update(verification.num_draft_tokens, verification.num_accepted)
        committed = [*proposal.token_ids[: verification.num_accepted], verification.next_token_id]
        emitted = self.output.accept(committed)
        if self.finished:
            self.release()
        return emitted

    def text(self) -> str:
        return self.output.text()

    def release(self) -> None:
        self.target_session.release()
        if self.drafter is not None:
            self.drafter.release()
