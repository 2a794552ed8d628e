"""Turn a `--draft` spec into a source of per-session drafters.

Specs: `ngram` (prompt lookup, no model); `int8`, `bf16`, `fp16` (a
reduced-precision copy of the target, the self-draft; `self:fp32` for an
exact copy); `default` (the shipped distilled draft in
services/models/default_draft; any `mirror-sd distill` folder works the
same way); `gguf:PATH` / `gguf:<built-in alias>` (a GGUF file drafting on
llama.cpp, drafters/gguf.py); `hybrid` / `hybrid:<model draft>` (prompt
lookup when the context has a match, else the model draft, `default`
unless named); `suffix` (suffix drafts over the conversation and the tenant's earlier outputs, no model:
drafters/suffix.py) / `suffix:<model draft>` (per round the suffix draft or the model draft, whichever promises
more tokens per ms); `auto` (the settings' default, `suffix:gguf:<alias>` for a built-in target: see
resolve_draft_spec); `none`
(target-only); `synthetic:<a>[@<ms>ms]` (benchmarks only: the target's greedy
token with probability a, from reference runs, at a chosen cost per token;
docs/synthetic.md); anything else is a model spec for
`load_model` (built-in alias, directory, GGUF file, cached HF id) that must
share the target's tokenizer.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from services.config import LlamaCppSettings, SpeculativeSettings, SuffixSettings
from services.models.builtin import BUILTIN_MODELS
from services.models.decoder import UnsupportedModelError
from services.models.drafters.base import Drafter
from services.models.drafters.batched import DraftEngine
from services.models.drafters.gguf import GGUF_PREFIX, is_gguf_spec, load_gguf_engine
from services.models.drafters.model import ModelDrafter
from services.models.drafters.hybrid import HybridDrafter
from services.models.drafters.history import History
from services.models.drafters.ngram import NgramDrafter
from services.models.drafters.suffix import Acceptance, SuffixDrafter, SuffixModelDrafter, SuffixOptions
from services.models.drafters.synthetic import SyntheticDrafter
from services.speculative.draft_choice import DraftPrices
from services.models.synthetic_spec import SYNTHETIC_PREFIX, ReferenceBook, parse_synthetic_spec
from services.models.llamacpp import LLAMA_CPP_PACKAGE, llama_cpp_available
from services.models.loading import LoadedModel, TargetVocab, check_same_tokenizer, load_model
from services.models.precision import PRECISIONS
from services.models.trimmed_draft import DEFAULT_DRAFT_DIR, is_trimmed_draft_dir, load_trimmed_draft

logger = logging.getLogger(__name__)

SELF_DRAFT_SHORTHANDS = ("int8", "bf16", "fp16")


AUTO = "auto"
SUFFIX = "suffix"
# What a draft worker serves with when its model draft cannot run on this machine (its engine faults in the
# check, or the process keeps crashing at start), saying so in its heartbeat (draft_fallback): suffix drafts
# alone, no model and no native code, so nothing to fault, and never the engine that failed.
FALLBACK_DRAFT = SUFFIX


def resolve_draft_spec(spec: str, target: str) -> str:
    """`auto` (target: an alias or a model's name): for a built-in target with llama-cpp-python installed, the
    per-round choice between suffix drafts and the target's own GGUF on llama.cpp (`suffix:gguf:<alias>`);
    otherwise suffix drafts alone, saying what to install for a built-in target. Other specs as given.
    The choice, not the GGUF draft alone: it measured faster on the dev set and the repeated-work set
    (docs/drafts.md). Suffix drafts alone, not prompt lookup: they read the conversation as lookup does, and
    the tenant's earlier outputs too, with no vocabulary to share (needs_target_vocab)."""
    if spec != AUTO:
        return spec
    alias = next((b.alias for b in BUILTIN_MODELS.values() if target in (b.alias, b.display_name)), None)
    if alias is None:
        return SUFFIX
    if not llama_cpp_available():
        logger.warning("draft auto: llama-cpp-python is not installed, drafting with suffix drafts alone (%s); "
                       "`mirror-sd llamacpp build` installs %s for the llama.cpp draft", SUFFIX, LLAMA_CPP_PACKAGE)
        return SUFFIX
    return f"{SUFFIX}:{GGUF_PREFIX}{alias}"


def is_suffix_spec(spec: str) -> bool:
    return spec == SUFFIX or spec.startswith(SUFFIX + ":")


def _model_half(spec: str) -> str:
    if spec.startswith(("hybrid:", SUFFIX + ":")):
        return spec.split(":", 1)[1]
    return "default" if spec == "hybrid" else spec


def needs_target_weights(spec: str) -> bool:
    """Whether building this draft needs the target loaded (self-drafts, torch drafts' tokenizer checks); a
    GGUF draft needs only the target's vocabulary (needs_target_vocab)."""
    return needs_target_vocab(spec) and not is_gguf_spec(_model_half(spec))


def needs_target_vocab(spec: str) -> bool:
    return spec not in ("none", "ngram", SUFFIX, AUTO) and not spec.startswith(SYNTHETIC_PREFIX)


def is_model_draft(spec: str) -> bool:
    """A draft that runs a model (it wants a core of its own), not prompt lookup or a replay."""
    return needs_target_vocab(spec)


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
    hybrid: bool = False  # prompt lookup first, the model draft when it finds nothing
    engine: DraftEngine | None = None  # a draft engine given whole (llama.cpp); else built from `model`
    suffix: SuffixSettings | None = None  # suffix drafts first (alone, or chosen per round against the model's)
    history: History | None = None  # the tenants' earlier outputs, shared by every session of the process
    # what suffix and model drafts earned in this process's sessions: the per-round choice of a new session
    # starts from them
    learned_suffix: Acceptance = field(default_factory=lambda: Acceptance(alpha=0.5, calibration=0.5))
    learned_model: Acceptance = field(default_factory=lambda: Acceptance(alpha=0.6))
    _engine_checked: bool = field(default=False, init=False, repr=False)

    @property
    def is_none(self) -> bool:
        return self.spec == "none"

    @property
    def stepwise(self) -> bool:
        """Whether its drafters are model drafts stepped token by token (Drafter.stepwise): a plain model
        draft, on the shared engine or with a cache of its own (not prompt lookup, hybrid or synthetic)."""
        return not self.is_none and self.references is None and not self.hybrid and self.suffix is None and (
            self.model is not None or self.engine is not None)

    @property
    def reads_prompt(self) -> bool:
        """Whether its drafters read the prompt before they draft (drafters/base.py reads_prompt): a stepwise
        model draft, or a per-round choice with a model half."""
        return self.stepwise or (self.suffix is not None and (self.model is not None or self.engine is not None))

    def _model_drafter(self) -> Drafter:
        """A session's model drafter: on the draft engine every session of the process shares (drafts of
        many sessions step together), or, for a model the packed forward cannot walk, a cache of its own."""
        if self.engine is None and not self._engine_checked:
            self._engine_checked = True
            if self.model.precision == "int8":
                # dynamic int8 quantises activations per tensor, so the engine would run it row by row
                # anyway (services/models/engine.py): a cache per session does the same with less overhead
                logger.info("draft %s (int8) drafts session by session", self.spec)
            else:
                try:
                    self.engine = DraftEngine.on_torch(self.model, chunk_size=self.chunk_size)
                except UnsupportedModelError as exc:
                    logger.info("draft %s drafts session by session: %s", self.spec, exc)
        if self.engine is not None:
            return self.engine.new_drafter(self.spec)
        return ModelDrafter(self.model, chunk_size=self.chunk_size, name=self.spec)

    def new_drafter(self) -> Drafter | None:
        if self.is_none:
            return None
        if self.references is not None:  # a bench's book must hold every prompt; a stack's may miss (target-only)
            return SyntheticDrafter(parse_synthetic_spec(self.spec), self.references, vocab_size=self.vocab_size,
                                    required=self.references.fetch is None)
        if self.suffix is not None:
            return self._suffix_drafter()
        lookup = NgramDrafter(ngram_max=self.ngram_max, ngram_min=self.ngram_min)
        if self.model is None and self.engine is None:
            return lookup
        model = self._model_drafter()
        return HybridDrafter(lookup, model, name=self.spec) if self.hybrid else model


    def shared_history(self) -> History | None:
        """The tenants' earlier outputs every suffix drafter of this source reads (made on first use); None
        for a draft without suffix drafts, or with history_tokens 0."""
        settings = self.suffix
        if self.history is None and settings is not None and settings.history_tokens > 0:
            self.history = History(capacity=settings.history_tokens, max_tenants=settings.max_tenants,
                                   share_across_tenants=settings.share_across_tenants, max_depth=settings.max_depth)
        return self.history

    def _suffix_drafter(self) -> Drafter:
        settings = self.suffix
        self.shared_history()
        options = SuffixOptions(max_depth=settings.max_depth, min_prob=settings.min_prob,
                                max_spec_factor=settings.max_spec_factor, max_spec_offset=settings.max_spec_offset,
                                min_match=settings.min_match, max_draft_tokens=settings.max_draft_tokens)
        prices = DraftPrices(model_draft=settings.model_draft_cost, verify_growth=settings.verify_growth)
        lookup = SuffixDrafter(self.history, options, name=self.spec, prices=prices, learned=self.learned_suffix)
        if self.model is None and self.engine is None:
            return lookup
        return SuffixModelDrafter(lookup, self._model_drafter(), name=self.spec, learned=self.learned_model)


def load_draft_source(
    spec: str,
    target: LoadedModel | TargetVocab,
    *,
    speculative: SpeculativeSettings | None = None,
    precision: str = "fp32",
    chunk_size: int = 512,
    llamacpp: LlamaCppSettings | None = None,
    num_threads: int | None = None,
    cache_dir: Path | None = None,
    suffix: SuffixSettings | None = None,
) -> DraftSource:
    """target: the loaded target, or for a GGUF draft just its vocabulary (TargetVocab); num_threads: the
    process's thread count (llama.cpp's default); cache_dir: where a GGUF draft's engine check is kept.
    Raises LlamaCppFaultError when a GGUF draft's llama.cpp faults here (see drafters/gguf.py)."""
    speculative = speculative or SpeculativeSettings()
    common = {"ngram_max": speculative.ngram_max, "ngram_min": speculative.ngram_min, "chunk_size": chunk_size}
    spec = resolve_draft_spec(spec, target.name)
    if spec in ("none", "ngram"):
        return DraftSource(spec, None, **common)
    if is_suffix_spec(spec):
        suffix = suffix or SuffixSettings()
        if spec == SUFFIX:
            return DraftSource(spec, None, suffix=suffix, **common)
        inner = _model_half(spec)
        if inner in ("none", "ngram", SUFFIX, AUTO) or inner.startswith(("hybrid", SUFFIX + ":", SYNTHETIC_PREFIX)):
            raise ValueError(f"draft {spec!r}: the part after 'suffix:' must be a model draft, not {inner!r}")
        model = load_draft_source(inner, target, speculative=speculative, precision=precision,
                                  chunk_size=chunk_size, llamacpp=llamacpp, num_threads=num_threads,
                                  cache_dir=cache_dir)
        return DraftSource(spec, model.model, engine=model.engine, suffix=suffix, vocab_size=model.vocab_size,
                           **common)
    if spec == "hybrid" or spec.startswith("hybrid:"):
        inner = _model_half(spec)
        if inner in ("none", "ngram", "hybrid", AUTO) or inner.startswith(("hybrid:", SYNTHETIC_PREFIX)):
            raise ValueError(f"draft {spec!r}: the hybrid's second half must be a model draft, not {inner!r}")
        model = load_draft_source(inner, target, speculative=speculative, precision=precision,
                                  chunk_size=chunk_size, llamacpp=llamacpp, num_threads=num_threads,
                                  cache_dir=cache_dir)
        return DraftSource(spec, model.model, hybrid=True, engine=model.engine, **common)
    if is_gguf_spec(spec):
        vocab = target if isinstance(target, TargetVocab) else TargetVocab.of(target)
        engine = load_gguf_engine(spec, vocab, llamacpp, num_threads=num_threads, chunk_size=chunk_size,
                                  cache_dir=cache_dir)
        return DraftSource(spec, None, engine=engine, vocab_size=vocab.vocab_size, **common)
    if isinstance(target, TargetVocab):
        raise ValueError(f"draft {spec!r} needs the target's weights loaded, not only its vocabulary")
    if spec.startswith(SYNTHETIC_PREFIX):
        parse_synthetic_spec(spec)
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
