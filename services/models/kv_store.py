"""The target's KV store: the keys and values of many sequences under one byte budget.

Each sequence owns one buffer, `[layers, 2 (keys, values), kv_heads, capacity,
head_dim]`, grown in pages of PAGE_TOKENS tokens. A forward writes only the
positions it appends (keys and values of a layer in one copy); a crop
(rejected draft tokens, a rollback) moves the length and touches no data; attention reads views `[kv_heads, length, head_dim]` of the
buffer. So no step copies a whole cache: the only copy is the one a buffer
makes when it outgrows its capacity, and capacity grows by at least half
each time (a sequence of n tokens is copied O(log n) times in its life).

A new sequence may start as a copy of another's prefix (prefix reuse: a
shared system prompt or document is prefilled once). The copy is taken once,
when the sequence starts, so no buffer is ever shared: a session never sees
another's tokens, and releasing or evicting one frees only its own memory.
Copying 1,000 positions costs a few milliseconds; prefilling them costs
seconds on a CPU.

The store counts reserved capacity, not just filled length, against the
budget, because that is the memory the process holds. Who is evicted when
the budget is exceeded is the owner's policy (the verify worker's LRU over
idle sessions), not the store's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

PAGE_TOKENS = 64
GROWTH = 1.5


@dataclass(frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    @property
    def bytes_per_token(self) -> int:
        """2 (keys, values) x layers x kv heads x head dim x bytes per element."""
        element_size = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element_size


def pages_for(num_tokens: int) -> int:
    return max(1, math.ceil(num_tokens / PAGE_TOKENS))


class SequenceKV:
    """One sequence's keys and values; `length` positions are valid."""

    def __init__(self, store: "KVStore") -> None:
        self.store = store
        self.length = 0
        self.capacity = 0
        self.kv: torch.Tensor | None = None  # [layers, 2, kv_heads, capacity, head_dim]
        self.released = False

    @property
    def reserved_bytes(self) -> int:
        return self.capacity * self.store.shape.bytes_per_token

    def reserve(self, num_tokens: int) -> None:
        """Make room for num_tokens positions in all (copies the filled part only when it grows)."""
        assert not self.released, "sequence already released"
        if num_tokens <= self.capacity:
            return
        wanted = max(num_tokens, int(self.capacity * GROWTH)) if self.capacity else num_tokens
        capacity = pages_for(wanted) * PAGE_TOKENS
        shape = self.store.shape
        size = (shape.num_layers, 2, shape.num_kv_heads, capacity, shape.head_dim)
        kv = torch.empty(size, dtype=shape.dtype, device=shape.device)
        if self.length:
            kv[:, :, :, : self.length].copy_(self.kv[:, :, :, : self.length])
        self.store._account(capacity - self.capacity)
        self.kv, self.capacity = kv, capacity

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """kv: [2, kv_heads, n, head_dim], keys then values, for positions start .. start + n - 1."""
        end = start + kv.shape[2]
        assert end <= self.capacity, f"write up to {end} past capacity {self.capacity}"
        self.kv[layer, :, :, start:end].copy_(kv)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads, end, head_dim] of positions 0 .. end - 1 (views, no copy)."""
        kv = self.kv[layer]
        return kv[0, :, :end], kv[1, :, :end]

    def copy_prefix(self, source: "SequenceKV", length: int) -> None:
        """Start this (empty) sequence with the first `length` positions of `source`: one copy, after which the
        two share nothing (either may grow, crop or be released without the other seeing it)."""
        assert self.length == 0, "a prefix is copied into an empty sequence only"
        assert 0 < length <= source.length, f"cannot copy {length} of {source.length} positions"
        self.reserve(length)
        self.kv[:, :, :, :length].copy_(source.kv[:, :, :, :length])
        self.length = length

    def crop(self, length: int) -> None:
        """Keep the first `length` positions (nothing moves)."""
        assert 0 <= length <= self.length, f"cannot crop {self.length} positions to {length}"
        self.length = length

    def release(self) -> None:
        """Give the memory back to the store; the sequence cannot be used again."""
        if self.released:
            return
        self.store._account(-self.capacity)
        self.store.num_sequences -= 1
        self.kv = None
        self.capacity = self.length = 0
        self.released = True


class KVStore:
    """Many sequences' buffers and the bytes they reserve, against `budget_bytes` (None = no budget)."""

    def __init__(self, shape: KVShape, *, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < PAGE_TOKENS * shape.bytes_per_token:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds less than one page of "
                             f"{PAGE_TOKENS} tokens ({PAGE_TOKENS * shape.bytes_per_token} bytes)")
        self.shape = shape
        self.budget_bytes = budget_bytes
        self._reserved_tokens = 0
        self.num_sequences = 0

    def allocate(self) -> SequenceKV:
        self.num_sequences += 1
        return SequenceKV(self)

    @property
    def used_bytes(self) -> int:
        return self._reserved_tokens * self.shape.bytes_per_token

    def growth_bytes(self, sequence: SequenceKV, num_tokens: int) -> int:
        """What reserving num_tokens positions in `sequence` would add to used_bytes."""
        if num_tokens <= sequence.capacity:
            return 0
        wanted = max(num_tokens, int(sequence.capacity * GROWTH)) if sequence.capacity else num_tokens
        return (pages_for(wanted) * PAGE_TOKENS - sequence.capacity) * self.shape.bytes_per_token

    def over_budget(self, extra_bytes: int = 0) -> bool:
        return self.budget_bytes is not None and self.used_bytes + extra_bytes > self.budget_bytes

    def _account(self, tokens: int) -> None:
        self._reserved_tokens += tokens
        assert self._reserved_tokens >= 0, "released more KV than was reserved"
