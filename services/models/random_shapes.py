"""Random-weight models of a named shape: timing the engine at sizes whose real weights cannot travel here
(e.g. a ~1B model on a GPU box that has no network). Never used to generate text."""

from __future__ import annotations

import logging

import torch

from services.models.loading import LoadedModel
from services.models.precision import apply_precision

logger = logging.getLogger(__name__)

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


def build_random_model(shape: str, *, precision: str = "fp32", device: str = "cpu", seed: int = 0) -> LoadedModel:
    """A Llama of the named shape with random weights, at `precision` on `device`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(seed)
    target_device = torch.device(device)
    with torch.device(target_device):  # built where it runs: a 1B model need not pass through host memory twice
        model = LlamaForCausalLM(config)
    model = apply_precision(model, precision, target_device)
    logger.info("random %s: %.0fM parameters, %s on %s", shape, sum(p.numel() for p in model.parameters()) / 1e6,
                precision, device)
    return LoadedModel(f"random-{shape}", model, None, precision, target_device)
