"""A suffix index over token sequences in a fixed amount of memory: the longest earlier match of a context's
tail, and what followed it, in microseconds.

Suffix decoding (arXiv 2411.04975) drafts from a suffix tree over the prompt, the output so far and earlier
outputs. This index answers the same question with hash chains instead of a tree, the way LZ77 compressors
find matches: every position is linked to the previous position whose last k tokens hash the same, for a few
key lengths k (8, 4, 2 by default). A lookup hashes the context's last k tokens, walks that chain back over at
most `max_candidates` recent occurrences, measures how far back each really matches (up to `max_depth`
tokens: a hash collision matches less than k and is dropped), keeps the occurrences with the longest match,
and walks their continuations forward together: at each position the most frequent next token among those
still agreeing, its frequency the estimated chance it is right. The longest key that finds anything wins, so a
long match is found even where a short key's chain is crowded with recent short ones.

A lookup costs Python operations, not tokens, so it spends few per occurrence: an occurrence is compared as a
slice of the ring's `array` against the tail's (one C-level comparison), one shorter than the longest so far
is dropped after that one comparison (it can no longer be kept), and the continuations are counted a column
at a time (a `Counter` only where no majority agrees with the first). tests/unit/test_suffix_index_reference.py
holds the same lookup written plainly, and the drafts must be equal.

Memory is fixed at construction, whatever is appended: a ring of `capacity` tokens (the oldest overwritten),
one `prev` link per token and key length, and one chain-head table per key length. A flood of unique text
evicts old text; it never grows the index. Sequences are appended as documents: a separator after each ends
every continuation there, so a draft never runs from one document into the next.

Why our own and not arctic-inference's C++ suffix tree (vLLM's `suffix` method): that tree grows with the
distinct suffixes it holds (a node per distinct path up to its depth), its wheel is built from an sdist with a
C++ toolchain, and it has no per-tenant partitioning of its global cache; this index is pure Python over
`array`s with a memory bound set by one number (docs/drafts.md, suffix drafts).
"""

from __future__ import annotations

import logging
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

logger = logging.getLogger(__name__)

SEPARATOR = -1  # between documents; never a token id, so it matches nothing and ends every continuation
EMPTY = -1  # a chain's end
_HASH_MULTIPLIER = 1_000_003


@dataclass(frozen=True)
class SuffixDraft:
    """A continuation of a context's tail drawn from the index."""

    token_ids: list[int] = field(default_factory=list)  # [num_draft_tokens]
    # per draft token: the estimated chance that it and every token before it are right (nonincreasing)
    cumulative_probs: list[float] = field(default_factory=list)
    match_length: int = 0  # how many tokens of the context's tail matched earlier text
    source: str = ""  # where it came from: "conversation" (the session's own context) or "history"

    @property
    def score(self) -> float:
        """Expected number of accepted draft tokens, if the frequencies were the acceptance chances."""
        return sum(self.cumulative_probs)

    def cut(self, num_draft_tokens: int) -> "SuffixDraft":
        return replace(self, token_ids=self.token_ids[:num_draft_tokens],
                       cumulative_probs=self.cumulative_probs[:num_draft_tokens])


def _key(tokens: Sequence[int]) -> int:
    key = 0
    for token in tokens:
        key = (key * _HASH_MULTIPLIER + token + 2) & 0xFFFF_FFFF_FFFF
    return key


def _tail(context: Sequence[int], max_depth: int) -> array:
    """The context's last max_depth tokens, as the ring holds them. A token the ring cannot hold (outside int32)
    matches nothing there, so no match reaches past it: the tail starts after the last such token."""
    tail = [int(token) for token in context[-max_depth:]]
    try:
        return array("i", tail)
    except OverflowError:
        last = max(i for i, token in enumerate(tail) if not -(1 << 31) <= token < 1 << 31)
        return array("i", tail[last + 1:])


def memory_bytes(capacity: int, key_lengths: Sequence[int], table_size: int) -> int:
    """What an index of these dimensions holds, bytes: tokens (4 each), a prev link per token and key length
    (8 each), a chain-head table per key length (8 a slot)."""
    return capacity * (4 + 8 * len(key_lengths)) + table_size * 8 * len(key_lengths)


class SuffixIndex:
    def __init__(self, capacity: int, *, key_lengths: Sequence[int] = (8, 4, 2), max_depth: int = 32,
                 max_candidates: int = 32, table_size: int | None = None) -> None:
        if capacity < 2:
            raise ValueError(f"suffix index capacity must be at least 2 tokens, got {capacity}")
        if not key_lengths or min(key_lengths) < 1:
            raise ValueError(f"suffix index key lengths must be positive, got {list(key_lengths)}")
        self.capacity = capacity
        self.key_lengths = sorted(set(key_lengths), reverse=True)
        self.max_depth = max(max_depth, self.key_lengths[0])
        self.max_candidates = max_candidates
        size = 1 << max(10, (capacity - 1).bit_length()) if table_size is None else table_size
        self.table_mask = size - 1
        assert size & self.table_mask == 0, "table_size must be a power of two"
        self.tokens = array("i", [SEPARATOR]) * capacity
        self.prev = [array("q", [EMPTY]) * capacity for _ in self.key_lengths]
        self.heads = [array("q", [EMPTY]) * size for _ in self.key_lengths]
        self.end = 0  # absolute position of the next token written; positions below end - capacity are gone
        self.doc_start = 0  # absolute position where the document being appended began
        self.num_documents = 0

    @property
    def memory_bytes(self) -> int:
        return memory_bytes(self.capacity, self.key_lengths, self.table_mask + 1)

    @property
    def num_tokens(self) -> int:
        """Tokens held now (separators included), at most capacity."""
        return min(self.end, self.capacity)

    # --- writing --------------------------------------------------------------------------------
    def extend(self, token_ids: Sequence[int]) -> None:
        """Append tokens to the current document (each linked into its chains)."""
        for token in token_ids:
            self._write(int(token))

    def end_document(self) -> None:
        """End the current document: what follows is another one."""
        if self.end > self.doc_start:
            self._write(SEPARATOR)
            self.num_documents += 1
        self.doc_start = self.end

    def add_document(self, token_ids: Sequence[int]) -> None:
        self.end_document()
        self.extend(token_ids)
        self.end_document()

    def _write(self, token: int) -> None:
        position = self.end
        slot = position % self.capacity
        self.tokens[slot] = token
        self.end = position + 1
        if token == SEPARATOR:
            for prev in self.prev:
                prev[slot] = EMPTY
            return
        for level, length in enumerate(self.key_lengths):
            start = position - length + 1
            if start < self.doc_start or start < self.end - self.capacity:
                self.prev[level][slot] = EMPTY  # the key would reach into another document or evicted text
                continue
            key = _key(self.tokens[s % self.capacity] for s in range(start, position + 1)) & self.table_mask
            self.prev[level][slot] = self.heads[level][key]
            self.heads[level][key] = position

    def truncate(self, length: int) -> None:
        """Forget the current document's tokens past absolute position `length` (a draft's own tokens that the
        target then rejected); only the document being appended can shrink."""
        length = max(length, self.doc_start)
        while self.end > length:
            position = self.end - 1
            slot = position % self.capacity
            for level, length_k in enumerate(self.key_lengths):
                if position - length_k + 1 < self.doc_start:
                    continue
                key = _key(self.tokens[s % self.capacity] for s in range(position - length_k + 1, position + 1))
                head = self.heads[level]
                if head[key & self.table_mask] == position:  # undo the link (positions were linked in order)
                    head[key & self.table_mask] = self.prev[level][slot]
            self.tokens[slot] = SEPARATOR
            self.end = position

    # --- reading --------------------------------------------------------------------------------
    def _segment(self, start: int, stop: int) -> list[int]:
        """The tokens at absolute positions [start, stop), SEPARATOR where evicted or not written yet: one or two
        slices of the ring."""
        low, high = max(start, self.end - self.capacity, 0), min(stop, self.end)
        if low >= high:
            return [SEPARATOR] * (stop - start)
        first, last = low % self.capacity, (high - 1) % self.capacity + 1
        if first < last:
            middle = self.tokens[first:last].tolist()
        else:  # across the ring's end
            middle = self.tokens[first:].tolist() + self.tokens[:last].tolist()
        return [SEPARATOR] * (low - start) + middle + [SEPARATOR] * (stop - high)

    def _span(self, start: int, stop: int) -> array:
        """The tokens at absolute positions [start, stop) as an `array`: one slice of the ring where it holds
        them all in order (nearly always), else `_segment`'s padded copy."""
        first = start % self.capacity
        if (start >= 0 and start >= self.end - self.capacity and stop <= self.end
                and first + stop - start <= self.capacity):
            return self.tokens[first:first + stop - start]
        return array("i", self._segment(start, stop))

    def _match_depth(self, position: int, tail: array, at_least: int) -> int:
        """How many last tokens of `tail` the text ending at `position` shares, when at least `at_least` (0 when
        fewer: such an occurrence can no longer be among the longest)."""
        depth_limit = len(tail)
        stop = position % self.capacity + 1
        if stop >= depth_limit and position - depth_limit + 1 >= self.end - self.capacity:  # `_span`, inlined
            earlier = self.tokens[stop - depth_limit:stop]
        else:
            earlier = self._span(position - depth_limit + 1, position + 1)
        if at_least == depth_limit:
            return depth_limit if earlier == tail else 0
        if earlier[-at_least:] != tail[-at_least:]:  # a hash collision, or a shorter match than the best so far
            return 0
        if earlier[-at_least - 1] != tail[-at_least - 1]:  # most occurrences match just that much
            return at_least
        if earlier == tail:
            return depth_limit
        # binary search (a shared suffix's own suffixes are shared), first near `at_least`: most matches end soon
        low, high = at_least + 1, depth_limit - 1  # low: shared; high + 1: not
        middle = min(2 * low, high)
        while low < high:
            if earlier[-middle:] == tail[-middle:]:
                low = middle
            else:
                high = middle - 1
            middle = (low + high + 1) // 2
        return low

    def _candidates(self, context: Sequence[int]) -> tuple[list[int], int]:
        """The occurrences (absolute positions of their last token) of the context's longest matching tail,
        most recent first, and that match's length; ([], 0) when nothing matches."""
        tail = _tail(context, self.max_depth)
        capacity, tokens, end = self.capacity, self.tokens, self.end
        oldest = max(end - capacity, 0)
        last = tail[-1] if tail else SEPARATOR
        for level, length in enumerate(self.key_lengths):
            if len(tail) < length:
                continue
            position = self.heads[level][_key(tail[-length:]) & self.table_mask]
            prev = self.prev[level]
            found: list[int] = []  # the occurrences matching `best` tokens, in chain order
            best = length  # a hash collision matches less than the key and is dropped
            steps = 0
            while position >= oldest and steps < self.max_candidates:  # EMPTY (-1) is below oldest too
                steps += 1
                # something followed it (not the end, not a document's end), and its last token is the tail's
                # (else a hash collision)
                if (position + 1 < end and tokens[(position + 1) % capacity] != SEPARATOR
                        and tokens[position % capacity] == last):
                    depth = self._match_depth(position, tail, best)  # 0, or at least best
                    if depth and (depth > best or not found):
                        best, found = depth, [position]
                    elif depth:
                        found.append(position)
                position = prev[position % capacity]
            if found:
                return found, best
        return [], 0

    def _continuations(self, positions: list[int], limit: int) -> list[array]:
        """The `limit` tokens after each position (`_span`, inlined where the ring holds them all in order)."""
        tokens, capacity, end = self.tokens, self.capacity, self.end
        slots = [position % capacity + 1 for position in positions]
        if all(position + 1 + limit <= end for position in positions) and max(slots) + limit <= capacity:
            return [tokens[slot:slot + limit] for slot in slots]
        return [self._span(position + 1, position + 1 + limit) for position in positions]

    def speculate(self, context: Sequence[int], max_tokens: int, *, min_prob: float = 0.1,
                  max_spec_factor: float = 1.0, max_spec_offset: float = 0.0) -> SuffixDraft:
        """The most likely continuation of `context`, up to max_tokens and at most max_spec_factor *
        match_length + max_spec_offset tokens (a short match predicts a short way), stopping where the chance
        that every token so far is right falls below min_prob."""
        if max_tokens <= 0 or not context:
            return SuffixDraft()
        positions, match_length = self._candidates(context)
        if not positions:
            return SuffixDraft()
        limit = max(0, min(max_tokens, int(max_spec_factor * match_length + max_spec_offset)))
        continuations = self._continuations(positions, limit)
        if len(continuations) == 1:  # one occurrence: its continuation up to the document's end, every chance 1
            following = continuations[0]
            length = following.index(SEPARATOR) if SEPARATOR in following else len(following)
            return SuffixDraft(following[:length].tolist(), [1.0] * length, match_length)
        token_ids, cumulative_probs = vote(continuations, limit, min_prob)
        return SuffixDraft(token_ids, cumulative_probs, match_length)


def vote(continuations: list[array], limit: int, min_prob: float) -> tuple[list[int], list[float]]:
    """Walk the occurrences' continuations (each `limit` tokens) forward together: at each offset the most
    frequent next token among those still agreeing (the first seen on a tie), its chance that frequency over
    those agreeing; stop at a document's end everywhere or where the chance so far falls below min_prob.
    Most offsets find most continuations agreeing: a count over one column; a Counter only where no majority
    agrees with the first."""
    token_ids: list[int] = []
    cumulative_probs: list[float] = []
    chance = 1.0
    alive = continuations
    # [limit][len(continuations)]: every column at once while all agree; once some drop out, a column is read
    # from those left when it is reached (fewer each time, and the walk may stop before the rest is read)
    columns: list[tuple[int, ...]] | None = list(zip(*alive))
    for offset in range(limit):
        column = columns[offset] if columns is not None else [following[offset] for following in alive]
        token = column[0]
        count = column.count(token)
        # more than half agreeing on the first one's token makes it the most frequent (as a rule they all agree)
        if token == SEPARATOR or 2 * count <= len(column):
            counts = Counter(column)
            counts.pop(SEPARATOR, None)
            if not counts:
                break
            token = max(counts, key=counts.__getitem__)  # the first of the most frequent, as most_common(1)
            count = counts[token]
        chance *= count / len(alive)
        if chance < min_prob:
            break
        token_ids.append(token)
        cumulative_probs.append(chance)
        if count != len(alive):
            alive = [following for following, next_id in zip(alive, column) if next_id == token]
            columns = None
    return token_ids, cumulative_probs
