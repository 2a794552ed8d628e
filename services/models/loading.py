"""Load a causal LM and its tokenizer by built-in alias, GGUF file, local directory or cached HF id.

Nothing is downloaded at run time: a model that is not on this machine is a
clear `ModelNotFoundError`, never a hang on the network.
"""

from __future__ import annotations

import copy
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from services.errors import ModelNotFoundError, TokenizerMismatchError
from services.models.builtin import BUILTIN_MODELS
from services.models.locate import resolve_model_dir
from services.models.tokenizer_loading import load_tokenizer
from services.models.precision import apply_precision

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    name: str
    model: nn.Module  # a transformers causal LM
    tokenizer: object | None  # a transformers tokenizer, or None for id-only models
    precision: str = "fp32"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    layout: str = "transposed"  # of fp32 CPU Linear weights (linear_layout.py)

    @property
    def config(self):
        return self.model.config

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 1 << 30))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        for source in (self.config, getattr(self.model, "generation_config", None), self.tokenizer):
            value = getattr(source, "eos_token_id", None) if source is not None else None
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    def with_precision(self, precision: str) -> "LoadedModel":
        """A copy of this model at another precision (the self-draft)."""
        model = apply_precision(copy.deepcopy(self.model), precision, self.device, layout=self.layout)
        return LoadedModel(f"{self.name}@{precision}", model, self.tokenizer, precision, self.device, self.layout)


def load_model(
    spec: str,  # also `random:<shape>[:<seed>]`: random weights (services/models/random_shapes.py)
    *,
    precision: str = "fp32",
    device: str | torch.device = "cpu",
    cache_dir: Path | None = None,
    layout: str | None = None,
) -> LoadedModel:
    from transformers import AutoModelForCausalLM

    from services.config import get_settings
    from services.models.random_shapes import load_random_model
    from services.models.random_spec import is_random_spec

    # Run-time loads never touch the network, whatever the caller's environment.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cache_dir = cache_dir or get_settings().cache_dir
    layout = layout or get_settings().cpu_weight_layout
    device = torch.device(device)
    if is_random_spec(spec):  # random weights of a named shape, built here (random_shapes.py)
        return load_random_model(spec, precision=precision, device=device, layout=layout, cache_dir=cache_dir)
    name, source = resolve_model_dir(spec, cache_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError) as exc:
        known = ", ".join(sorted(BUILTIN_MODELS))
        raise ModelNotFoundError(
            f"model {spec!r} not found: not a built-in alias ({known}), a local directory, a .gguf "
            f"file, or a Hugging Face id in the local cache (Mirror-SD never downloads at run time)"
        ) from exc
    try:
        tokenizer = load_tokenizer(source)
    except (OSError, ValueError, TypeError):
        logger.warning("model %s has no tokenizer; it accepts token ids only", spec)
        tokenizer = None
    from services.engine.layout_choice import resolve_layout

    layout = resolve_layout(model, name, tokenizer, precision=precision, device=device, layout=layout,
                            cache_dir=cache_dir)
    model = apply_precision(model, precision, device, layout=layout)
    logger.info("loaded %s (%s) at %s on %s", name, source, precision, device)
    return LoadedModel(name, model, tokenizer, precision, device, layout)


@dataclass(frozen=True)
class TargetVocab:
    """What a draft must agree with: the target's token ids (its tokenizer) and logits width."""

    name: str
    tokenizer: object | None
    vocab_size: int

    @classmethod
    def of(cls, loaded: LoadedModel) -> "TargetVocab":
        return cls(loaded.name, loaded.tokenizer, loaded.vocab_size)


def load_target_vocab(spec: str, *, cache_dir: Path | None = None) -> TargetVocab:
    """The target's tokenizer and vocabulary size without its weights (a draft worker that drafts with
    llama.cpp never runs the target)."""
    from transformers import AutoConfig

    from services.config import get_settings
    from services.models.random_shapes import random_target_vocab
    from services.models.random_spec import is_random_spec

    if is_random_spec(spec):
        return random_target_vocab(spec)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name, source = resolve_model_dir(spec, cache_dir or get_settings().cache_dir)
    try:
        config = AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"model {spec!r} not found (Mirror-SD never downloads at run time)") from exc
    try:
        tokenizer = load_tokenizer(source)
    except (OSError, ValueError, TypeError):
        tokenizer = None
    return TargetVocab(name, tokenizer, int(config.vocab_size))


def _vocab(loaded: LoadedModel) -> dict[str, int] | None:
    return loaded.tokenizer.get_vocab() if loaded.tokenizer is not None else None


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """Refuse a draft that does not speak the target's token ids."""
    target_vocab, draft_vocab = _vocab(target), _vocab(draft)
    if target_vocab is not None and draft_vocab is not None:
        same = target_vocab == draft_vocab
        target_size, draft_size = len(target_vocab), len(draft_vocab)
    else:
        target_size, draft_size = target.vocab_size, draft.vocab_size
        same = target_size == draft_size
    if not same:
        raise TokenizerMismatchError(
            f"draft {draft.name!r} (vocab size {draft_size}) does not share the tokenizer of "
            f"target {target.name!r} (vocab size {target_size}); speculative decoding needs the same token ids"
        )
