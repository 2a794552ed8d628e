"""Turn a `--draft` spec into a source of per-session drafters.

Specs: `ngram` (prompt lookup, no model); `int8`, `bf16`, `fp16` (a
reduced-precision copy of the target, the self-draft; `self:fp32` for an
exact copy); `default` (the shipped distilled draft in
services/models/default_draft; any `mirror-sd distill` folder works the
same way); `hybrid` / `hybrid:<model draft>` (prompt lookup when the context
has a match, else the model draft, `default` unless named); `none`
(target-only); `synthetic:<a>` (benchmarks only: the target's greedy token
with probability a, from reference runs); anything else is a model spec for
`load_model` (built-in alias, directory, GGUF file, cached HF id) that must
share the target's tokenizer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from services.config import SpeculativeSettings
from services.models.decoder import UnsupportedModelError
from services.models.drafters.base import Drafter
from services.models.drafters.batched import DraftEngine
from services.models.drafters.model import ModelDrafter
from services.models.drafters.hybrid import HybridDrafter
from services.models.drafters.ngram import NgramDrafter
from services.models.drafters.synthetic import (
    SYNTHETIC_PREFIX,
    ReferenceBook,
    SyntheticDrafter,
    parse_synthetic_acceptance,
)
from services.models.loading import LoadedModel, check_same_tokenizer, load_model
from services.models.precision import PRECISIONS
from services.models.trimmed_draft import DEFAULT_DRAFT_DIR, is_trimmed_draft_dir, load_trimmed_draft

logger = logging.getLogger(__name__)

SELF_DRAFT_SHORTHANDS = ("int8", "bf16", "fp16")


def needs_target_weights(spec: str) -> bool:
    """Whether building this draft needs the target loaded (self-drafts, tokenizer checks)."""
    return spec not in ("none", "ngram") and not spec.startswith(SYNTHETIC_PREFIX)


@dataclass
class DraftSource:
    """Loaded once per process; hands each session its own drafter."""

    spec: str
    model: LoadedModel | None = None  # None for n-gram and target-only
    ngram_max: int = 4
    ngram_min: int = 2
    chunk_size: int = 512
    references: ReferenceBook | None = None  # synthetic drafts only
    vocab_size: int = 0
    hybrid: bool = False  # prompt lookup first, `model` when it finds nothing
    _engine: DraftEngine | None = field(default=None, init=False, repr=False)
    _engine_checked: bool = field(default=False, init=False, repr=False)

    @property
    def is_none(self) -> bool:
        return self.spec == "none"

    def _model_drafter(self) -> Drafter:
        """A session's model drafter: on the draft engine every session of the process shares (drafts of
        many sessions step together), or, for a model the packed forward cannot walk, a cache of its own."""
        if not self._engine_checked:
            self._engine_checked = True
            if self.model.precision == "int8":
                # dynamic int8 quantises activations per tensor, so the engine would run it row by row
                # anyway (services/models/engine.py): a cache per session does the same with less overhead
                logger.info("draft %s (int8) drafts session by session", self.spec)
            else:
                try:
                    self._engine = DraftEngine(self.model, chunk_size=self.chunk_size)
                except UnsupportedModelError as exc:
                    logger.info("draft %s drafts session by session: %s", self.spec, exc)
        if self._engine is not None:
            return self._engine.new_drafter(self.spec)
        return ModelDrafter(self.model, chunk_size=self.chunk_size, name=self.spec)

    def new_drafter(self) -> Drafter | None:
        if self.is_none:
            return None
        if self.references is not None:
            return SyntheticDrafter(parse_synthetic_acceptance(self.spec), self.references,
                                    vocab_size=self.vocab_size)
        lookup = NgramDrafter(ngram_max=self.ngram_max, ngram_min=self.ngram_min)
        if self.model is None:
            return lookup
        model = self._model_drafter()
        return HybridDrafter(lookup, model, name=self.spec) if self.hybrid else model


def load_draft_source(
    spec: str,
    target: LoadedModel,
    *,
    speculative: SpeculativeSettings | None = None,
    precision: str = "fp32",
    chunk_size: int = 512,
) -> DraftSource:
    speculative = speculative or SpeculativeSettings()
    common = {"ngram_max": speculative.ngram_max, "ngram_min": speculative.ngram_min, "chunk_size": chunk_size}
    if spec in ("none", "ngram"):
        return DraftSource(spec, None, **common)
    if spec == "hybrid" or spec.startswith("hybrid:"):
        inner = spec.split(":", 1)[1] if ":" in spec else "default"
        if inner in ("none", "ngram", "hybrid") or inner.startswith(("hybrid:", SYNTHETIC_PREFIX)):
            raise ValueError(f"draft {spec!r}: the hybrid's second half must be a model draft, not {inner!r}")
        model = load_draft_source(inner, target, speculative=speculative, precision=precision, chunk_size=chunk_size)
        return DraftSource(spec, model.model, hybrid=True, **common)
    if spec.startswith(SYNTHETIC_PREFIX):
        parse_synthetic_acceptance(spec)
        return DraftSource(spec, None, references=ReferenceBook(), vocab_size=target.vocab_size, **common)
    self_precision = spec if spec in SELF_DRAFT_SHORTHANDS else None
    if spec.startswith("self:"):
        self_precision = spec.split(":", 1)[1]
        if self_precision not in PRECISIONS:
            raise ValueError(f"draft {spec!r}: precision must be one of {', '.join(PRECISIONS)}")
    if self_precision is not None:
        return DraftSource(spec, target.with_precision(self_precision), **common)
    if spec == "default" or is_trimmed_draft_dir(Path(spec)):
        directory = DEFAULT_DRAFT_DIR if spec == "default" else Path(spec)
        return DraftSource(spec, load_trimmed_draft(directory, target, name=spec), **common)
    draft = load_model(spec, precision=precision, device=target.device)
    check_same_tokenizer(target, draft)
    return DraftSource(spec, draft, **common)
