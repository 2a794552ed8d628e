"""Shared fixtures: tiny random Llama models built from a config, the real built-in model, dev prompts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from services.bench.prompts import DEV_PROMPTS_PATH
from services.models.loading import LoadedModel
from services.models.precision import apply_precision
from tests.redis_dbs import DATABASES

torch.set_num_threads(int(os.environ.get("MIRROR_SD_TEST_THREADS", "2")))

REPO_ROOT = Path(__file__).resolve().parent.parent
# The repository's own copy (data/README.md); MIRROR_SD_DEV_PROMPTS points the tests at another one.
DEV_PROMPTS = Path(os.environ.get("MIRROR_SD_DEV_PROMPTS", DEV_PROMPTS_PATH))

TINY_VOCAB = 96


def build_tiny_llama(
    seed: int,
    *,
    vocab_size: int = TINY_VOCAB,
    max_position_embeddings: int = 256,
    initializer_range: float = 0.2,
    eos_token_id: int | None = None,
    name: str | None = None,
) -> LoadedModel:
    """A 2-layer Llama with random weights; a wide init keeps logits well apart (no argmax ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = apply_precision(LlamaForCausalLM(config), "fp32", torch.device("cpu"))  # as load_model does
    return LoadedModel(name or f"tiny-llama-{seed}", model, None)


def save_tiny_model(directory, *, seed: int, words: list[str]) -> Path:
    """A tiny Llama plus a word-level tokenizer whose vocabulary is `words`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {word: index for index, word in enumerate(words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    loaded = build_tiny_llama(seed, vocab_size=len(words))
    loaded.model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


WORDS = ["<unk>", "</s>", *[f"w{index}" for index in range(62)]]


def perturbed_copy(loaded: LoadedModel, *, scale: float, seed: int) -> LoadedModel:
    """The same model with noise on every weight: a draft that mostly agrees."""
    import copy

    model = copy.deepcopy(loaded.model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * scale * parameter.std())
    return LoadedModel(f"{loaded.name}-perturbed", model, None)


@pytest.fixture(scope="session")
def tiny_target() -> LoadedModel:
    return build_tiny_llama(0)


@pytest.fixture(scope="session")
def builtin_target() -> LoadedModel:
    """The real SmolLM2-135M-Instruct, fp32 (converted once into the user cache)."""
    from services.models.loading import load_model

    return load_model("smollm2-135m")


def load_dev_prompts() -> list[dict]:
    """The dev set as raw records; it ships in the repository, so a missing file is a failure, not a skip."""
    with DEV_PROMPTS.open() as handle:
        return [json.loads(line) for line in handle if line.strip()]


@pytest.fixture(scope="session")
def dev_prompts() -> list[dict]:
    return load_dev_prompts()


@pytest.fixture
def redis_url():
    """A test Redis database of this test's own, empty (tests/redis_dbs.py hands them out)."""
    with DATABASES.lease() as url:
        yield url
