"""The target's KV store: the keys and values of many sequences under one byte budget.

Each sequence owns one slot of a shelf: the shelf of a capacity holds every
sequence of that capacity side by side, `[layers, 2 (keys, values), slots,
kv_heads, capacity, head_dim]`, so one attention call covers a shelf's rows
(services/models/decoder.py). Capacities come in classes (1, 2, 3, 4, 6, 8,
12 ... pages of PAGE_TOKENS tokens), so sequences of like lengths share a
shelf. A forward writes only the positions it appends; a crop (rejected
draft tokens, a rollback) moves the length and touches no data; attention
reads views of the shelf. So no step copies a whole cache: a sequence is
copied when it outgrows its capacity (to a slot of a larger class, at least
half as large again, so O(log n) times in its life) and a shelf is copied
when it doubles or halves its slots.

A new sequence may start as a copy of another's prefix (prefix reuse: a
shared system prompt or document is prefilled once). The copy is taken once,
when the sequence starts, so no slot is ever shared: a session never sees
another's tokens, and releasing or evicting one frees its own slot.
Copying 1,000 positions costs a few milliseconds; prefilling them costs
seconds on a CPU.

The store counts the capacity its sequences reserve against the budget; the
free slots beside them on their shelves show in `held_bytes`. Who is evicted when the budget is exceeded is the owner's
policy (the verify worker's LRU over idle sessions), not the store's.
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


def capacity_for(num_tokens: int) -> int:
    """The smallest capacity class holding num_tokens: 1, 2, 3, 4, 6, 8, 12, 16, ... pages (powers of two and
    one and a half times them), so a capacity is at most half again the pages asked and sequences of like
    lengths share a shelf."""
    pages = pages_for(num_tokens)
    power = 1 << (pages.bit_length() - 1)  # the largest power of two <= pages
    if pages == power:
        return pages * PAGE_TOKENS
    return (3 * power // 2 if pages <= 3 * power // 2 else 2 * power) * PAGE_TOKENS


class Shelf:
    """The buffers of every sequence of one capacity, side by side in one tensor
    `[layers, 2, slots, kv_heads, capacity, head_dim]`, one slot per sequence. Slots are handed out lowest
    first and the tensor doubles when full and halves when its upper half is empty, so the live sequences
    sit in a short run of slots: one attention call covers them (services/models/decoder.py).

    Its tensor starts zeroed: attention over a run of slots reads positions no sequence wrote, masked, and a
    masked position's value is multiplied by a zero weight, which is only zero when the value is finite.
    Its tensors are normal ones even when a forward (in inference mode) makes them, so a shelf made by one
    forward takes a prefix copy between forwards."""

    def __init__(self, shape: KVShape, capacity: int) -> None:
        self.shape, self.capacity = shape, capacity
        self.taken: list[bool] = []  # by slot (not the sequences themselves: no reference cycle holds a shelf)
        self.tensor = self._zeros(0)

    def _zeros(self, slots: int) -> torch.Tensor:
        shape = self.shape
        with torch.inference_mode(False):  # a normal tensor, written in a forward's inference mode and out of it
            return torch.zeros((shape.num_layers, 2, slots, shape.num_kv_heads, self.capacity, shape.head_dim),
                               dtype=shape.dtype, device=shape.device)

    def _resize(self, slots: int) -> None:
        tensor = self._zeros(slots)
        kept = min(slots, len(self.taken))
        tensor[:, :, :kept].copy_(self.tensor[:, :, :kept])
        self.tensor = tensor
        self.taken = self.taken[:kept] + [False] * (slots - kept)

    @property
    def held_bytes(self) -> int:
        return len(self.taken) * self.capacity * self.shape.bytes_per_token

    @property
    def empty(self) -> bool:
        return not any(self.taken)

    def take(self) -> int:
        """The lowest free slot, now taken (the tensor doubles when every slot is taken)."""
        for slot, taken in enumerate(self.taken):
            if not taken:
                break
        else:
            slot = len(self.taken)
            self._resize(max(1, 2 * len(self.taken)))
        self.taken[slot] = True
        return slot

    def give_back(self, slot: int) -> None:
        self.taken[slot] = False
        while len(self.taken) > 1 and not any(self.taken[len(self.taken) // 2:]):
            self._resize(len(self.taken) // 2)


class SequenceKV:
    """One sequence's keys and values: a slot of the shelf of its capacity; `length` positions are valid."""

    def __init__(self, store: "KVStore") -> None:
        self.store = store
        self.length = 0
        self.capacity = 0
        self.shelf: Shelf | None = None
        self.slot = 0
        self.released = False

    @property
    def kv(self) -> torch.Tensor:
        """This sequence's buffer [layers, 2, kv_heads, capacity, head_dim] (a view of its shelf)."""
        assert self.shelf is not None, "no buffer reserved"
        return self.shelf.tensor[:, :, self.slot]

    @property
    def reserved_bytes(self) -> int:
        return self.capacity * self.store.shape.bytes_per_token

    def reserve(self, num_tokens: int) -> None:
        """Make room for num_tokens positions in all: a slot on a larger shelf, the filled part copied."""
        assert not self.released, "sequence already released"
        if num_tokens <= self.capacity:
            return
        capacity = self.store.capacity_to_hold(self, num_tokens)
        shelf = self.store.shelf(capacity)
        slot = shelf.take()
        if self.length:
            shelf.tensor[:, :, slot, :, : self.length].copy_(self.kv[:, :, :, : self.length])
        self._leave_shelf()
        self.store._account(capacity - self.capacity)
        self.shelf, self.slot, self.capacity = shelf, slot, capacity

    def _leave_shelf(self) -> None:
        if self.shelf is not None:
            self.shelf.give_back(self.slot)
            self.store.drop_if_empty(self.shelf)
            self.shelf = None

    def write(self, layer: int, start: int, kv: torch.Tensor) -> None:
        """kv: [2, kv_heads, n, head_dim], keys then values, for positions start .. start + n - 1."""
        end = start + kv.shape[2]
        assert end <= self.capacity, f"write up to {end} past capacity {self.capacity}"
        self.shelf.tensor[layer, :, self.slot, :, start:end].copy_(kv)

    def view(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [kv_heads, end, head_dim] of positions 0 .. end - 1 (views, no copy)."""
        kv = self.shelf.tensor[layer]
        return kv[0, self.slot, :, :end], kv[1, self.slot, :, :end]

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
        self._leave_shelf()
        self.store._account(-self.capacity)
        self.store.num_sequences -= 1
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
        self.shelves: dict[int, Shelf] = {}

    def allocate(self) -> SequenceKV:
        self.num_sequences += 1
        return SequenceKV(self)

    def shelf(self, capacity: int) -> Shelf:
        if capacity not in self.shelves:
            self.shelves[capacity] = Shelf(self.shape, capacity)
        return self.shelves[capacity]

    def drop_if_empty(self, shelf: Shelf) -> None:
        if shelf.empty and self.shelves.get(shelf.capacity) is shelf:
            del self.shelves[shelf.capacity]

    @property
    def held_bytes(self) -> int:
        """The memory the shelves hold: the sequences' reserved bytes and the free slots beside them."""
        return sum(shelf.held_bytes for shelf in self.shelves.values())

    @staticmethod
    def capacity_to_hold(sequence: SequenceKV, num_tokens: int) -> int:
        """The capacity `sequence` moves to for num_tokens positions: at least GROWTH times what it has, so a
        sequence of n tokens is copied O(log n) times in its life."""
        wanted = max(num_tokens, int(sequence.capacity * GROWTH)) if sequence.capacity else num_tokens
        return capacity_for(wanted)

    @property
    def used_bytes(self) -> int:
        return self._reserved_tokens * self.shape.bytes_per_token

    def growth_bytes(self, sequence: SequenceKV, num_tokens: int) -> int:
        """What reserving num_tokens positions in `sequence` would add to used_bytes."""
        if num_tokens <= sequence.capacity:
            return 0
        return (self.capacity_to_hold(sequence, num_tokens) - sequence.capacity) * self.shape.bytes_per_token

    def over_budget(self, extra_bytes: int = 0) -> bool:
        return self.budget_bytes is not None and self.used_bytes + extra_bytes > self.budget_bytes

    def _account(self, tokens: int) -> None:
        self._reserved_tokens += tokens
        assert self._reserved_tokens >= 0, "released more KV than was reserved"
