"""Random-weight models of a named shape: timing the engine, or a whole stack (`--target random:<shape>`), at
sizes whose real weights cannot travel here (e.g. a ~1B model on a GPU box that has no network). Their text
means nothing; what they are for is the time a step takes.

The weights are a pure function of the shape, the seed, the device type and the torch version: every process
that builds `random:llama-1b` on the CPU holds the same weights, so the stack's verify workers and the bench's
`ar` mode decode the same model, and greedy output through the stack can be checked token for token."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.models.loading import LoadedModel, TargetVocab
from services.models.precision import apply_precision
from services.models.random_tokenizer import random_tokenizer

logger = logging.getLogger(__name__)

RANDOM_PREFIX = "random:"

# Llama-architecture shapes (hidden, intermediate, layers, heads, kv heads, vocab) of well-known checkpoints.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),  # Llama 3.2 1B
    "llama-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256),  # Llama 3.1 8B
}
MAX_CONTEXT = 4096


@dataclass(frozen=True)
class RandomSpec:
    """`random:<shape>` or `random:<shape>:<seed>` (seed 0 unless given)."""

    shape: str
    seed: int = 0

    @property
    def name(self) -> str:
        """What the model is called in heartbeats, status and reports: random weights, said so."""
        return f"random-{self.shape}" + (f"-seed{self.seed}" if self.seed else "")


def is_random_spec(spec: str) -> bool:
    return spec.startswith(RANDOM_PREFIX)


def parse_random_spec(spec: str) -> RandomSpec:
    """`random:llama-1b` -> RandomSpec("llama-1b", 0); `random:tiny:7` -> seed 7. A bad one names itself."""
    if not is_random_spec(spec):
        raise ValueError(f"model {spec!r} is not a random-weight spec (random:<shape>[:<seed>])")
    shape, _, seed_text = spec[len(RANDOM_PREFIX):].partition(":")
    if shape not in SHAPES:
        raise ValueError(f"model {spec!r}: unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if not seed_text:
        return RandomSpec(shape)
    if not seed_text.isdigit():
        raise ValueError(f"model {spec!r}: the seed {seed_text!r} must be a whole number >= 0")
    return RandomSpec(shape, int(seed_text))


def _config(shape: str):
    from transformers import LlamaConfig

    # eos 2 is the random tokenizer's <|im_end|> (and LlamaConfig's default); bos stays off: prompts are text
    return LlamaConfig(**SHAPES[shape], max_position_embeddings=MAX_CONTEXT, tie_word_embeddings=False,
                       bos_token_id=None, eos_token_id=2, pad_token_id=None)


def random_target_vocab(spec: str) -> TargetVocab:
    """A random target's vocabulary without its weights (a draft worker, the gateway)."""
    parsed = parse_random_spec(spec)
    vocab_size = SHAPES[parsed.shape]["vocab_size"]
    return TargetVocab(parsed.name, random_tokenizer(vocab_size), vocab_size)


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
