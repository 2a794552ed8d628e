"""The suffix index's lookup against a slow reference: the lookup as it was before it compared `array` slices
and skipped occurrences shorter than the best so far (lists, a binary search per occurrence, a Counter per
offset). Both read the same index, so any difference in a draft is the lookup's."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.models.drafters.suffix_index import EMPTY, SEPARATOR, SuffixDraft, SuffixIndex, _key


def _segment(index: SuffixIndex, start: int, stop: int) -> list[int]:
    low, high = max(start, index.end - index.capacity, 0), min(stop, index.end)
    if low >= high:
        return [SEPARATOR] * (stop - start)
    middle = [index.tokens[p % index.capacity] for p in range(low, high)]
    return [SEPARATOR] * (low - start) + middle + [SEPARATOR] * (stop - high)


def _common_suffix(earlier: list[int], tail: list[int]) -> int:
    depth = 0
    while depth < len(tail) and earlier[-1 - depth] == tail[-1 - depth]:
        depth += 1
    return depth


def _candidates(index: SuffixIndex, context: list[int]) -> tuple[list[int], int]:
    tail = [int(t) for t in context[-index.max_depth:]]
    for level, length in enumerate(index.key_lengths):
        if len(tail) < length:
            continue
        position = index.heads[level][_key(tail[-length:]) & index.table_mask]
        found: list[tuple[int, int]] = []
        steps = 0
        while position != EMPTY and position >= max(index.end - index.capacity, 0) and steps < index.max_candidates:
            steps += 1
            if position + 1 < index.end and index.tokens[(position + 1) % index.capacity] != SEPARATOR:
                depth = _common_suffix(_segment(index, position - len(tail) + 1, position + 1), tail)
                if depth >= length:
                    found.append((position, depth))
            position = index.prev[level][position % index.capacity]
        if found:
            best = max(depth for _, depth in found)
            return [position for position, depth in found if depth == best], best
    return [], 0


def reference_speculate(index: SuffixIndex, context: list[int], max_tokens: int, *, min_prob: float = 0.1,
                        max_spec_factor: float = 1.0, max_spec_offset: float = 0.0) -> SuffixDraft:
    if max_tokens <= 0 or not context:
        return SuffixDraft()
    positions, match_length = _candidates(index, context)
    if not positions:
        return SuffixDraft()
    limit = min(max_tokens, int(max_spec_factor * match_length + max_spec_offset))
    continuations = [_segment(index, position + 1, position + 1 + limit) for position in positions]
    if len(continuations) == 1:
        following = continuations[0]
        length = following.index(SEPARATOR) if SEPARATOR in following else len(following)
        return SuffixDraft(following[:length], [1.0] * length, match_length)
    token_ids: list[int] = []
    cumulative_probs: list[float] = []
    chance = 1.0
    alive = continuations
    for offset in range(limit):
        counts = Counter(following[offset] for following in alive if following[offset] != SEPARATOR)
        if not counts:
            break
        token, count = counts.most_common(1)[0]
        chance *= count / len(alive)
        if chance < min_prob:
            break
        token_ids.append(token)
        cumulative_probs.append(chance)
        alive = [following for following in alive if following[offset] == token]
    return SuffixDraft(token_ids, cumulative_probs, match_length)


def _edited_copies(rng: random.Random, base: list[list[int]], num_copies: int, vocab: int) -> list[list[int]]:
    """Copies of the base documents with a few tokens replaced, dropped or inserted (repeated work)."""
    documents = []
    for _ in range(num_copies):
        for doc in base:
            copy = []
            for token in doc:
                roll = rng.random()
                if roll < 0.03:
                    copy.append(rng.randrange(vocab))
                elif roll >= 0.06:
                    copy.append(token)
                if 0.06 <= roll < 0.09:
                    copy.append(rng.randrange(vocab))
            documents.append(copy)
    return documents


def _contexts(rng: random.Random, documents: list[list[int]], num_contexts: int) -> list[list[int]]:
    contexts = []
    for _ in range(num_contexts):
        doc = rng.choice(documents)
        stop = rng.randrange(1, len(doc) + 1)
        contexts.append(doc[max(0, stop - rng.randrange(1, 48)):stop])
    return contexts


def _assert_same_drafts(index: SuffixIndex, contexts: list[list[int]], **options) -> int:
    """Every context's draft equal to the reference's; how many drafted anything."""
    drafted = 0
    for context in contexts:
        for max_tokens in (1, 4, 16):
            expected = reference_speculate(index, context, max_tokens, **options)
            assert index.speculate(context, max_tokens, **options) == expected, (context, max_tokens)
            drafted += bool(expected.token_ids)
    return drafted


@pytest.mark.parametrize("seed", range(4))
def test_drafts_equal_the_reference_on_repetitive_text(seed):
    rng = random.Random(seed)
    vocab = rng.choice((8, 50, 2000))  # a tiny vocabulary: long chains of short keys and many ties
    base = [[rng.randrange(vocab) for _ in range(rng.randrange(5, 120))] for _ in range(20)]
    documents = _edited_copies(rng, base, 6, vocab)
    # a ring smaller than the text: eviction and reads across the ring's end; a tiny table: collisions
    index = SuffixIndex(rng.choice((3000, 20000)), table_size=rng.choice((1024, None)),
                        max_candidates=rng.choice((4, 32)))
    for doc in documents:
        index.add_document(doc)
    contexts = _contexts(rng, documents, 150) + _contexts(rng, base, 50)
    drafted = _assert_same_drafts(index, contexts, max_spec_factor=1.0, max_spec_offset=1.0)
    drafted += _assert_same_drafts(index, contexts[:50], min_prob=0.01, max_spec_factor=2.0)
    assert drafted > 100


def test_drafts_equal_the_reference_on_random_text_and_odd_contexts():
    rng = random.Random(7)
    index = SuffixIndex(5000)
    for _ in range(150):
        index.add_document([rng.randrange(300) for _ in range(rng.randrange(1, 60))])
    index.extend([rng.randrange(300) for _ in range(40)])  # a document still being written: no end yet
    tail = [index.tokens[p % index.capacity] for p in range(index.end - 20, index.end)]
    contexts = _contexts(rng, [[rng.randrange(300) for _ in range(80)] for _ in range(50)], 100)
    contexts += [tail, tail[-3:], [SEPARATOR, *tail[-2:]], [1 << 40, *tail[-5:]], [5, -(1 << 40)], [3]]
    _assert_same_drafts(index, contexts, max_spec_factor=1.0, max_spec_offset=1.0)
    _assert_same_drafts(index, contexts, min_prob=0.0, max_spec_factor=0.0)  # no room: empty drafts


def test_drafts_equal_the_reference_after_truncates():
    rng = random.Random(3)
    index = SuffixIndex(1024)
    text = [rng.randrange(20) for _ in range(600)]
    index.add_document(text[:300])
    index.extend(text[300:])
    for cut in (550, 500, 320, 290):
        index.truncate(cut)
        index.extend([rng.randrange(20) for _ in range(30)])
        _assert_same_drafts(index, _contexts(rng, [text], 40), max_spec_factor=1.0, max_spec_offset=1.0)
