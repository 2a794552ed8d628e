"""Sampling parameters: what a request asks of the sampler, carried whole from the gateway to every worker.

Torch-free (services/protocol.py nests them in a SessionSpec); the warp and the samplers that use them are
in services/speculative/sampling.py.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, fields

GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20  # top_logprobs per token, as OpenAI's chat API allows
PENALTY_LIMIT = 2.0  # presence and frequency penalties lie in [-2, 2] (OpenAI)
BIAS_LIMIT = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI)
REPETITION_RANGE = (0.01, 100.0)  # vLLM asks only > 0; a denormal one would divide a logit to inf


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 means no top-k; seed None means random.

    The logits processing before the warp (services/speculative/processing.py), each off at its default:
    logit_bias, (token id, bias) pairs added to the logits; repetition_penalty (vLLM's), dividing a positive
    logit (multiplying a negative one) of every token already in the prompt or the output; frequency_penalty and
    presence_penalty (OpenAI's), subtracting count x frequency + presence from each token already in the output.
    logprobs: None for none, else the emitted tokens' log probabilities with this many alternatives (0-20).
    grammar: structured output, as grammar text (services/speculative/grammar.py), or None for free text."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer or null, got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
                raise ValueError(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value!r}")
        low, high = REPETITION_RANGE
        if not _is_number(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition_penalty must be in [{low:g}, {high:g}], got {self.repetition_penalty!r}")
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or null, got {self.logprobs!r}")
        if self.grammar is not None and not (isinstance(self.grammar, str) and self.grammar):
            raise ValueError(f"grammar must be grammar text or null, got {self.grammar!r}")

    @property
    def processes_logits(self) -> bool:
        """Whether any penalty or bias changes the target's logits before the warp."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)

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
        """Every value, as services/protocol.py carries them whole in a SessionSpec (logit_bias as pairs)."""
        wire = asdict(self)
        wire["logit_bias"] = [list(pair) for pair in self.logit_bias]
        return wire

    @classmethod
    def from_wire(cls, data: dict) -> "SamplingParams":
        """Inverse of to_wire: missing values take their defaults, unknown ones are ignored, bad ones a ValueError."""
        return cls(**{item.name: data[item.name] for item in fields(cls) if item.name in data})



def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """logit_bias as sorted (token id, bias) pairs, from pairs or a {token id: bias} map; ValueError naming the bad
    entry."""
    items = value.items() if isinstance(value, dict) else value
    pairs: dict[int, float] = {}
    for item in items or ():
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"logit_bias: expected (token id, bias) pairs, got {item!r}")
        token_id, bias = item
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"logit_bias: token ids are integers >= 0, got {token_id!r}")
        if not _is_number(bias) or not -BIAS_LIMIT <= bias <= BIAS_LIMIT:
            raise ValueError(f"logit_bias[{token_id}] must be in [-{BIAS_LIMIT:g}, {BIAS_LIMIT:g}], got {bias!r}")
        pairs[token_id] = float(bias)
    return tuple(sorted(pairs.items()))
