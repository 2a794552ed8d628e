"""A synthetic drafter for systems benchmarking: acceptance and cost chosen, not earned.

`synthetic:0.9@8ms` proposes, at each position, the target's own greedy token with probability 0.9 and a
wrong one otherwise, and spends 8 ms per proposed token, so a bench reads the suite at a chosen acceptance
and draft cost whatever the draft quality (e.g. a big random-weight target drafted cheaply, as an edge box
would). The cost is a sleep: it models an edge box's draft time without taking a core from the target. The
target's greedy continuation comes from a reference run (the bench's `ar` mode) registered per prompt: in
process (`sd:synthetic:<a>`), or published to Redis for a stack's drafts (services/synthetic.py). Whether a
position is right is a pure function of the seed, the prompt and the position, so a speculation drafted
twice proposes the same tokens. Never a default, and labelled synthetic in every report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from services.models.drafters.base import DraftProposal
from services.models.synthetic_spec import ReferenceBook, SyntheticSpec, is_right, prompt_digest
from services.speculative.params import SamplingParams

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


class SyntheticDrafter:
    """required: raise on a context no reference starts (the bench, where the ar mode always ran first);
    else propose nothing for it (a stack serving a request no bench published), so it decodes target-only."""

    def __init__(self, spec: SyntheticSpec | float, references: ReferenceBook, *, vocab_size: int, seed: int = 0,
                 required: bool = True, sleep: Callable[[float], None] = time.sleep) -> None:
        self.spec = spec if isinstance(spec, SyntheticSpec) else SyntheticSpec(spec)
        self.name = self.spec.name
        self.acceptance = self.spec.acceptance
        self.references = references
        self.vocab_size = vocab_size
        self.seed = seed
        self.required = required
        self.sleep = sleep
        self._reference: list[int] | None = None
        self._digest = ""
        self._looked = False

    def propose(
        self,
        context_ids: Sequence[int],
        num_draft_tokens: int,
        sampling: SamplingParams,
        generator: torch.Generator | None,
    ) -> DraftProposal:
        if not self._looked:
            found = self.references.find_with_prompt(context_ids)
            if found is None and self.required:
                raise ValueError("synthetic draft: no reference run for this prompt (run the ar mode first)")
            self._looked = True
            if found is None:
                logger.info("synthetic draft: no reference run for a %d-token prompt; it decodes target-only",
                            len(context_ids))
            else:
                self._digest, self._reference = prompt_digest(found[0]), found[1]
        if self._reference is None:
            return DraftProposal([], None)
        start = len(context_ids)
        truth = self._reference[start : start + num_draft_tokens]
        draft_ids = [token if is_right(self.seed, self._digest, start + offset, self.acceptance)
                     else (token + 1) % self.vocab_size for offset, token in enumerate(truth)]
        if draft_ids and self.spec.ms_per_token:
            self.sleep(self.spec.ms_per_token * len(draft_ids) / 1000)  # the modeled draft time, no CPU
        return DraftProposal(draft_ids, None)  # a point mass, like prompt lookup

    def release(self) -> None:
        self._reference = None
        self._looked = False
