"""One request in-process: draft a block, run the round (services/engine/target.py) at batch 1, adapt gamma.

The verify worker runs the very same round over many sessions per step;
this loop only adds the drafter and the block-length controller that the
draft worker holds in the distributed suite. Round r's draft randomness is
the stream ("draft", r), as on a draft worker, so a seeded request samples
the same text here and over HTTP.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from services.engine.options import GenerationOptions
from services.engine.stopping import OutputState
from services.engine.context import check_request_fits
from services.engine.target import TargetSession, run_step
from services.speculative.processing import TokenLogprobs
from services.models.engine import TargetEngine, TorchEngine
from services.models.drafters.base import DraftProposal, Drafter, longer_allowed, reads_prompt
from services.models.drafters.target_kv import link_target
from services.models.drafters.batched import bound_draft_context
from services.models.drafters.suffix import bind_prices, learned_prior
from services.models.loading import LoadedModel
from services.speculative.block_length import BlockLengthController, opens_plain, within_limits
from services.speculative.stats import SpecDecodingStats, model_round

logger = logging.getLogger(__name__)

_NO_DRAFT = DraftProposal([], None)


class GenerationSession:
    def __init__(
        self,
        target: LoadedModel,
        drafter: Drafter | None,
        prompt_ids: Sequence[int],
        options: GenerationOptions | None = None,
        engine: TargetEngine | None = None,
    ) -> None:
        options = options or GenerationOptions()
        check_request_fits(target.name, target.max_context, len(prompt_ids), options.max_new_tokens)
        self.target = target
        self.engine = engine or TorchEngine(target)
        self.drafter = drafter
        bound_draft_context(drafter, len(prompt_ids), options.speculative.draft_context_tokens)
        self.sampling = options.sampling
        self.chunk_size = options.chunk_size
        output = OutputState.for_request(target, max_new_tokens=options.max_new_tokens, stop=options.stop,
                                         ignore_eos=options.ignore_eos)
        cost = options.cost if options.speculative.block_policy == "cost" else None
        # a per-round choice's model half starts from what this process measured of it (a worker's sessions
        # start from their worker's recent rounds the same way: RecentRounds)
        self.controller = BlockLengthController(options.speculative, options.num_draft_tokens, cost,
                                                prior=learned_prior(drafter))
        bind_prices(drafter, options.cost, self.controller.prior)
        self.draft_s = 0.0  # wall time in drafter.propose
        self.verify_s = 0.0  # wall time in the target's forwards (prefill included)
        self.prompt_ids = list(prompt_ids)
        self.logprobs = TokenLogprobs()  # of output_ids, when the sampling params ask for them
        self._remembered = False
        # target-only decoding (no drafter) decodes a token a forward, a grammar's forced tokens included
        self.target_session = TargetSession(self.engine, prompt_ids, output=output, sampling=self.sampling,
                                            forced_drafts=drafter is not None)
        link_target(drafter, self.target_session)  # a draft that copies the target takes its KV of the prompt
        self._plain_opening = opens_plain(options.speculative, len(self.prompt_ids),
                                          reads_prompt(drafter))

    @property
    def output(self) -> OutputState:
        return self.target_session.output

    @property
    def stats(self) -> SpecDecodingStats:
        return self.target_session.stats

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
        if self.drafter is None or self._plain_opening:
            return 0
        return within_limits(self.controller.num_draft_tokens, self.output.remaining, self.target_session.room)

    def step(self) -> list[int]:
        """Run one round; return the tokens it added to the output (maybe none, at EOS)."""
        assert not self.finished, "session already finished"
        num_draft_tokens = self._block_length()
        self._plain_opening = False
        proposal = _NO_DRAFT
        started = time.perf_counter()
        if num_draft_tokens > 0:
            stream = self.sampling.make_stream("draft", self.target_session.round_index)
            longest = within_limits(self.output.remaining, self.output.remaining, self.target_session.room)
            proposal = self.drafter.propose(self.target_session.token_ids, num_draft_tokens, self.sampling, stream,
                                            **longer_allowed(self.drafter, longest))
        drafted = time.perf_counter()
        self.target_session.set_draft(proposal.token_ids, proposal.probs, proposal.drafter)
        result = None
        while result is None:  # a long prompt is prefilled in chunks first
            result = run_step(self.engine, [self.target_session], [self.chunk_size])[0]
        self.draft_s += drafted - started
        self.verify_s += time.perf_counter() - drafted
        verification = result.verification
        # the controller steers the model draft: a suffix draft's round counts as a target-only one there
        self.controller.update(*model_round(proposal.drafter, verification.num_draft_tokens, verification.num_accepted))
        emitted_logprobs = result.emitted_logprobs()
        if emitted_logprobs is not None:
            self.logprobs.extend(emitted_logprobs)
        if self.finished:
            self.release()
        return result.emitted

    def text(self) -> str:
        return self.output.text()

    def release(self) -> None:
        self.target_session.release()
        if self.drafter is not None:
            remember = getattr(self.drafter, "remember", None)  # suffix drafts: the output joins the history
            if remember is not None and self.finished and not self._remembered:
                self._remembered = True
                remember(self.prompt_ids, self.output_ids)
            self.drafter.release()
