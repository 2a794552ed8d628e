"""The draft a worker process serves with: a remote draft worker's, or a verify worker's drafting for its own
sessions (placement local). One rule for both: a model draft whose engine faults here (its check in a child
process, services/models/llamacpp_check.py) is replaced by suffix drafts alone (FALLBACK_DRAFT), once and
loudly, and the fallback travels in the worker's heartbeat (draft_fallback)."""

from __future__ import annotations

import logging

from services.config import Settings
from services.models.drafters.factory import (
    FALLBACK_DRAFT,
    DraftSource,
    is_suffix_spec,
    load_draft_source,
    needs_target_vocab,
    needs_target_weights,
    resolve_draft_spec,
)
from services.models.synthetic_spec import is_synthetic_spec, parse_synthetic_spec
from services.models.llamacpp_check import LlamaCppFaultError
from services.models.loading import LoadedModel
from services.protocol import DraftFallback

logger = logging.getLogger(__name__)

LOOKUP_VOCAB = 1000  # enough for profiling prompt lookup or suffix drafts, which read no vocabulary


def load_serving_draft(settings: Settings, target: LoadedModel | None = None,
                       num_threads: int | None = None) -> tuple[DraftSource, int, DraftFallback | None]:
    """The draft this process serves with, the vocabulary size to profile it at, and why it is not the one it
    was given (None when it is). target: the target when this process holds it (a verify worker); else the
    target's vocabulary or weights are loaded as the draft needs them. num_threads: llama.cpp's (default the
    process's)."""
    spec = resolve_draft_spec(settings.draft, settings.target)
    if is_synthetic_spec(spec):
        source = synthetic_serving_draft(settings, spec, target)
        return source, source.vocab_size, None
    fallback = None
    crashed = settings.worker.crashed_draft
    if crashed is not None:  # restarted so by `mirror-sd up` after crashing at start
        fallback = DraftFallback(draft=crashed.draft, fault=crashed.fault, reason=crashed.reason, serving=spec)
    if not needs_target_vocab(spec):
        return model_free_source(spec, settings), LOOKUP_VOCAB, fallback
    if target is None:
        from services.models.loading import load_model, load_target_vocab

        # a GGUF draft checks the target's vocabulary only: its weights stay on the verify side
        target = (load_model(settings.target, precision="fp32", device="cpu", cache_dir=settings.cache_dir)
                  if needs_target_weights(spec) else load_target_vocab(settings.target, cache_dir=settings.cache_dir))
    try:
        source = load_draft_source(spec, target, speculative=settings.speculative,
                                   precision=settings.draft_precision, chunk_size=settings.prefill_chunk_size,
                                   llamacpp=settings.llamacpp, num_threads=num_threads or settings.num_threads,
                                   cache_dir=settings.cache_dir, suffix=settings.suffix)
    except LlamaCppFaultError as exc:
        if not settings.worker.draft_fallback:
            raise
        fallback = DraftFallback(draft=spec, fault=exc.check.fault or "failed", reason=exc.check.describe(),
                                 serving=FALLBACK_DRAFT)
        logger.error("%s (%s; worker.draft_fallback: false fails instead)", fallback.describe(),
                     exc.check.kept_note() or "the check ran in a child process")
        return model_free_source(FALLBACK_DRAFT, settings), target.vocab_size, fallback
    return source, target.vocab_size, fallback


def model_free_source(spec: str, settings: Settings) -> DraftSource:
    """A draft with no model (`none`, `ngram`, `suffix`): the one given, or the fallback of a model draft
    (for `suffix:<model draft>` too: suffix drafts alone, never the model half that failed)."""
    assert not needs_target_vocab(spec), spec
    return DraftSource(spec, None, settings.speculative.ngram_max, settings.speculative.ngram_min,
                       suffix=settings.suffix if is_suffix_spec(spec) else None)


def synthetic_serving_draft(settings: Settings, spec: str, target: LoadedModel | None) -> DraftSource:
    """A synthetic draft serving a stack (docs/synthetic.md): it replays the references the bench's ar mode
    publishes to Redis (services/synthetic.py), so it needs only the target's vocabulary size, never its
    weights or a core. Labelled in the log, as everywhere."""
    from services.models.loading import load_target_vocab
    from services.synthetic import redis_reference_book

    parse_synthetic_spec(spec)
    vocab_size = (target or load_target_vocab(settings.target, cache_dir=settings.cache_dir)).vocab_size
    logger.warning("SYNTHETIC draft %s: acceptance chosen, not earned; its references come from `mirror-sd bench` "
                   "(ar mode) through Redis, and a prompt without one is decoded target-only", spec)
    return DraftSource(spec, None, settings.speculative.ngram_max, settings.speculative.ngram_min,
                       references=redis_reference_book(settings.redis_url), vocab_size=vocab_size)
