"""Sampling parameters: what a request asks of the sampler, carried whole from the gateway to every worker.

Torch-free (services/protocol.py nests them in a SessionSpec); the warp and the samplers that use them are
in services/speculative/sampling.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields

GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 means no top-k; seed None means random."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or null, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_BELOW are greedy (as in vLLM): dividing logits by 1e-300 gives inf - inf."""
        return self.temperature < GREEDY_BELOW

    @property
    def layout_free(self) -> bool:
        """Its tokens do not hang on where a request's rounds fall (which are drafted, which target-only, which a
        verify worker bridged): greedy, or unseeded. A seeded request draws round r from its own streams."""
        return self.greedy or self.seed is None

    def make_generator(self, offset: int = 0, device="cpu"):
        """A seeded torch.Generator; `offset` separates the draft's stream from the target's."""
        import torch  # here, not at the top: this module stays torch-free

        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed((self.seed + offset) % 2**64)
        return generator

    def make_stream(self, role: str, index: int = 0, device="cpu"):
        """A seeded torch.Generator for one named stream, e.g. ("draft", round 7): distinct (role, index)
        pairs never share random numbers (seed + offset schemes collide across processes)."""
        import torch

        generator = torch.Generator(device=device)
        if self.seed is None:
            generator.seed()
        else:
            digest = hashlib.blake2b(f"{self.seed}:{role}:{index}".encode(), digest_size=8).digest()
            generator.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        return generator

    def to_wire(self) -> dict:
        """The four values, as services/protocol.py carries them whole in a SessionSpec."""
        return asdict(self)

    @classmethod
    def from_wire(cls, data: dict) -> "SamplingParams":
        """Inverse of to_wire: missing values take their defaults, unknown ones are ignored, bad ones a ValueError."""
        return cls(**{item.name: data[item.name] for item in fields(cls) if item.name in data})

