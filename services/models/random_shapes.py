"""Random-weight models of a named shape: timing the engine, or a whole stack (`--target random:<shape>`), at
sizes whose real weights cannot travel here (e.g. a ~1B model on a GPU box that has no network). Their text
means nothing; what they are for is the time a step takes.

The weights are a pure function of the shape, the seed, the device type and the torch version: every process
that builds `random:llama-1b` on the CPU holds the same weights, so the stack's verify workers and the bench's
`ar` mode decode the same model, and greedy output through the stack can be checked token for token."""

from __future__ import annotations

import logging

import torch

from services.models.loading import LoadedModel, TargetVocab
from services.models.precision import apply_precision
from services.models.random_spec import MAX_CONTEXT, SHAPES, RandomSpec, parse_random_spec
from services.models.random_tokenizer import random_tokenizer

logger = logging.getLogger(__name__)

def _config(shape: str):
    from transformers import LlamaConfig

    # eos 2 is the random tokenizer's <|im_end|> (and LlamaConfig's default); bos stays off: prompts are text
    return LlamaConfig(**SHAPES[shape], max_position_embeddings=MAX_CONTEXT, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=2, pad_token_id=None)


def random_target_vocab(spec: str) -> TargetVocab:
    """A random target's vocabulary without its weights (a draft worker)."""
    parsed = parse_random_spec(spec)
    return TargetVocab(parsed.name, random_tokenizer(parsed.vocab_size), parsed.vocab_size)


def build_random_model(shape: str, *, precision: str = "fp32", device: str = "cpu", seed: int = 0,
                       layout: str = "transposed", cache_dir=None) -> LoadedModel:
    """A Llama of the named shape with random weights drawn from `seed` alone, at `precision` on `device`."""
    from transformers import LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    config = _config(shape)
    target_device = torch.device(device)
    # a private RNG state: the weights depend on the seed alone, and the caller's RNG is left as it was
    with torch.random.fork_rng(devices=[target_device] if target_device.type == "cuda" else []):
        torch.manual_seed(seed)
        with target_device:  # built where it runs: a 1B model need not pass through host memory twice
            model = LlamaForCausalLM(config)
    tokenizer = random_tokenizer(config.vocab_size)
    from services.engine.layout_choice import resolve_layout

    layout = resolve_layout(model, RandomSpec(shape, seed).name, tokenizer, precision=precision,
                            device=target_device, layout=layout, cache_dir=cache_dir)
    model = apply_precision(model, precision, target_device, layout=layout)
    logger.info("random %s (seed %d): %.0fM parameters, %s on %s", shape, seed,
                sum(p.numel() for p in model.parameters()) / 1e6, precision, device)
    return LoadedModel(RandomSpec(shape, seed).name, model, tokenizer, precision, target_device, layout)


def load_random_model(spec: str, *, precision: str = "fp32", device: str | torch.device = "cpu",
                      layout: str = "transposed", cache_dir=None) -> LoadedModel:
    parsed = parse_random_spec(spec)
    return build_random_model(parsed.shape, precision=precision, device=str(device), seed=parsed.seed, layout=layout,
                              cache_dir=cache_dir)
