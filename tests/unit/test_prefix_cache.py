"""The pure parts of prefix reuse: the common-prefix length, which source wins, and the retired LRU."""

import torch

from services.engine.prefix_cache import PrefixSource, RetiredPrefixes, best_prefix, common_prefix_length
from services.models.kv_store import KVShape, KVStore

SHAPE = KVShape(num_layers=1, num_kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"))


def sequence(store: KVStore, length: int, fill: float = 1.0):
    seq = store.allocate()
    seq.reserve(length)
    seq.kv[:, :, :, :length] = fill
    seq.length = length
    return seq


def test_common_prefix_length_across_chunk_boundaries():
    base = list(range(300))
    assert common_prefix_length(base, base) == 300
    assert common_prefix_length(base, base[:10]) == 10
    for cut in (0, 1, 63, 64, 65, 128, 299):
        other = [*base[:cut], -1, *base[cut + 1:]]
        assert common_prefix_length(base, other) == cut
    assert common_prefix_length([], base) == 0
    assert common_prefix_length(tuple(base), base) == 300  # a tuple against a list


def test_the_longest_reusable_prefix_wins_and_live_sources_win_ties():
    store = KVStore(SHAPE)
    tokens = list(range(100))
    live = PrefixSource("live", tokens[:60], sequence(store, 60), retired=False)
    retired = PrefixSource("old", tokens[:60], sequence(store, 60), retired=True)
    longer = PrefixSource("longer", [*tokens[:80], 999], sequence(store, 81), retired=True)
    assert best_prefix(tokens, [retired, live], min_tokens=8).source.key == "live"
    match = best_prefix(tokens, [live, longer], min_tokens=8)
    assert (match.source.key, match.length) == ("longer", 80)
    assert best_prefix(tokens[:50], [longer], min_tokens=8).length == 49  # never the last token
    assert best_prefix(tokens, [live], min_tokens=61) is None


def test_only_cached_positions_count():
    """A sequence still being prefilled holds fewer positions than it has tokens."""
    store = KVStore(SHAPE)
    tokens = list(range(100))
    prefilling = PrefixSource("p", tokens, sequence(store, 30), retired=False)
    assert best_prefix(tokens, [prefilling], min_tokens=8).length == 30


def test_copy_prefix_copies_and_shares_nothing():
    store = KVStore(SHAPE)
    source = sequence(store, 70, fill=2.0)
    copy = store.allocate()
    copy.copy_prefix(source, 65)
    assert copy.length == 65 and torch.equal(copy.kv[:, :, :, :65], source.kv[:, :, :, :65])
    source.kv.fill_(0.0)  # the source moves on (or is released): the copy keeps its own values
    assert bool((copy.kv[:, :, :, :65] == 2.0).all())
    assert store.used_bytes == (source.capacity + copy.capacity) * SHAPE.bytes_per_token


def test_retired_prefixes_are_bounded_lru_and_release_their_memory():
    store = KVStore(SHAPE)
    retired = RetiredPrefixes(max_entries=2)
    for key in ("a", "b", "c"):
        retired.retire(key, list(range(64)), sequence(store, 64))
    assert [source.key for source in retired] == ["b", "c"]  # a was the oldest
    assert store.num_sequences == 2
    retired.touch("b")
    assert retired.evict_one(keep={"x"}) and [source.key for source in retired] == ["b"]  # c was least recent
    assert not retired.evict_one(keep={"b"})
    retired.clear()
    assert store.used_bytes == 0 and len(retired) == 0
    off = RetiredPrefixes(max_entries=0)
    off.retire("a", [1, 2], sequence(store, 2))
    assert len(off) == 0 and store.used_bytes == 0


def test_sources_of_another_cache_salt_are_never_reused():
    store = KVStore(SHAPE)
    tokens = list(range(100))
    theirs = PrefixSource("theirs", tokens, sequence(store, 90), retired=True, salt="tenant-a")
    plain = PrefixSource("plain", tokens, sequence(store, 40), retired=True)
    assert best_prefix(tokens, [theirs, plain], min_tokens=8).source.key == "plain"  # no salt: only unsalted
    assert best_prefix(tokens, [theirs, plain], min_tokens=8, salt="tenant-a").source.key == "theirs"
    assert best_prefix(tokens, [theirs, plain], min_tokens=8, salt="tenant-b") is None
