"""Prefix reuse: a new sequence starts from the keys and values of the longest common token prefix another
sequence already holds, instead of prefilling it (a shared system prompt, the same document with a new
question, a retried request).

Sources are the sequences in use (live sessions) and `RetiredPrefixes`: the KV of finished sessions, kept
least recently used first while the budget allows, the first thing evicted when memory is needed. The
reused positions are copied (services/models/kv_store.py SequenceKV.copy_prefix), so nothing is shared
after the copy.

The KV at position i depends only on tokens 0..i, so the copied prefix is what a prefill of the same tokens
computes (up to the rounding of another batch shape, as for any batched or chunked step).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from services.models.kv_store import SequenceKV

CHUNK = 64  # tokens compared per slice (list slices compare at C speed)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    limit = min(len(a), len(b))
    start = 0
    while start < limit:
        end = min(start + CHUNK, limit)
        if a[start:end] == b[start:end]:
            start = end
            continue
        for position in range(start, end):
            if a[position] != b[position]:
                return position
        start = end  # equal items in sequences of different types (a list and a tuple)
    return limit


@dataclass(frozen=True)
class PrefixSource:
    key: str  # the request whose sequence holds the prefix
    token_ids: Sequence[int]  # the tokens of its cached positions (at least sequence.length of them)
    sequence: SequenceKV
    retired: bool  # a finished session's KV, kept for reuse
    salt: str | None = None  # reused only by sessions of the same cache salt


@dataclass(frozen=True)
class PrefixMatch:
    source: PrefixSource
    length: int  # positions to copy


def reusable_length(token_ids: Sequence[int], source: PrefixSource) -> int:
    """Positions of `source` a sequence of `token_ids` can start from: the common prefix of what the source
    has cached, and never the last token (its logits must come from a forward)."""
    cached = source.sequence.length
    return min(common_prefix_length(token_ids, source.token_ids[:cached]), len(token_ids) - 1)


def best_prefix(token_ids: Sequence[int], sources: Iterable[PrefixSource], *, min_tokens: int,
                salt: str | None = None) -> PrefixMatch | None:
    """The source of the same salt sharing the longest prefix with token_ids (at least min_tokens); live
    sources win ties (a retired one stays free to be evicted)."""
    best: PrefixMatch | None = None
    for source in sources:
        if source.salt != salt or source.sequence.released or source.sequence.length < min_tokens \
                or not source.token_ids or source.token_ids[0] != token_ids[0]:
            continue
        length = reusable_length(token_ids, source)
        if length >= min_tokens and (best is None or length > best.length
                                     or (length == best.length and best.source.retired and not source.retired)):
            best = PrefixMatch(source, length)
    return best


class RetiredPrefixes:
    """Finished sessions' sequences, least recently used first, at most max_entries of them. Their memory stays
    counted in the KV store's budget; whoever needs it evicts them first (evict_one)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[str, PrefixSource] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[PrefixSource]:
        return iter(list(self._entries.values()))

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def retire(self, key: str, token_ids: Sequence[int], sequence: SequenceKV, salt: str | None = None) -> None:
        """Keep `sequence` (now owned here) for reuse; releases it at once when nothing may be kept."""
        self.discard(key)
        if self.max_entries <= 0 or sequence.length == 0:
            sequence.release()
            return
        self._entries[key] = PrefixSource(key, list(token_ids[: sequence.length]), sequence, retired=True, salt=salt)
        while len(self._entries) > self.max_entries:
            self.evict_one()

    def touch(self, key: str) -> None:
        if key in self._entries:
            self._entries.move_to_end(key)

    def discard(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.sequence.release()

    def evict_one(self, *, keep: frozenset[str] | set[str] = frozenset()) -> bool:
        """Release the least recently used entry not in keep; False when there is none."""
        for key in self._entries:
            if key not in keep:
                self.discard(key)
                return True
        return False

    def clear(self) -> None:
        for key in list(self._entries):
            self.discard(key)
