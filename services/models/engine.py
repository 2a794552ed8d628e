"""The engine interface: what a pool's hardware runs for the target, one step over many sessions.

An engine owns the KV store its sessions live in and runs one forward over
ragged rows (services/models/decoder.py). The round logic above it
(services/engine/target.py) never touches tensors of the model, so another
engine (llama.cpp for CPU pools, say) plugs in by offering the same three
things: a KV store, new sequences, and `forward(rows)`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from services.models.decoder import ForwardRow, decoder_parts, packed_forward
from services.models.kv_store import KVStore, SequenceKV
from services.models.loading import LoadedModel

logger = logging.getLogger(__name__)


class TargetEngine(Protocol):
    target: LoadedModel
    store: KVStore

    def new_sequence(self) -> SequenceKV:
        ...

    def forward(self, rows: Sequence[ForwardRow]) -> list[torch.Tensor | None]:
        """Append each row's tokens to its sequence; float32 CPU logits [num_logits, vocab] per row."""
        ...


class TorchEngine:
    """The target on torch (CPU or CUDA): packed forward over the model's own modules."""

    def __init__(self, target: LoadedModel, *, budget_bytes: int | None = None) -> None:
        self.target = target
        self.parts = decoder_parts(target.model)
        if target.precision == "int8":  # every other op is exact per token: attention in double to match
            self.parts.attention_dtype = torch.float64
        dtype = self.parts.embed.weight.dtype  # the activations' dtype: fp32 for fp32 and int8, else bf16/fp16
        self.store = KVStore(self.parts.kv_shape(dtype, self.parts.embed.weight.device), budget_bytes=budget_bytes)

    def new_sequence(self) -> SequenceKV:
        return self.store.allocate()

    def forward(self, rows: Sequence[ForwardRow]) -> list[torch.Tensor | None]:
        logits = packed_forward(self.parts, rows)
        return [None if item is None else item.cpu() for item in logits]
