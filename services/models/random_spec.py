"""`random:<shape>[:<seed>]`: a random-weight target of a well-known checkpoint's shape, named by a spec. The spec
and the shapes alone (no torch): the gateway, `up` and `status` read them; services/models/random_shapes.py builds
the models."""

from __future__ import annotations

from dataclasses import dataclass


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
    def vocab_size(self) -> int:
        return SHAPES[self.shape]["vocab_size"]

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
