"""The KV store's shelves: capacity classes, slots handed out lowest first, shelves that double and halve,
sequences that move to a larger class with their data, and memory that starts zeroed."""

from __future__ import annotations

import torch

from services.models.kv_store import PAGE_TOKENS, KVShape, KVStore, capacity_for, pages_for

SHAPE = KVShape(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))


def test_capacities_come_in_classes_at_most_half_again_the_pages_asked():
    pages = [capacity_for(n) // PAGE_TOKENS for n in (1, 64, 65, 129, 193, 257, 385, 513, 769, 1025)]
    assert pages == [1, 1, 2, 3, 4, 6, 8, 12, 16, 24]
    for tokens in range(1, 5000, 37):
        assert tokens <= capacity_for(tokens) <= 3 * pages_for(tokens) * PAGE_TOKENS // 2 or tokens <= PAGE_TOKENS


def test_slots_lowest_first_shelves_double_and_halve():
    store = KVStore(SHAPE)
    sequences = [store.allocate() for _ in range(5)]
    for sequence in sequences:
        sequence.reserve(10)
    shelf = store.shelves[PAGE_TOKENS]
    assert [sequence.slot for sequence in sequences] == [0, 1, 2, 3, 4] and len(shelf.taken) == 8
    sequences[1].release()
    again = store.allocate()
    again.reserve(5)
    assert again.slot == 1  # the lowest free slot
    for sequence in (sequences[3], sequences[4]):
        sequence.release()
    assert len(shelf.taken) == 4  # the upper half emptied: halved
    assert store.used_bytes == 3 * PAGE_TOKENS * SHAPE.bytes_per_token == store.held_bytes - PAGE_TOKENS * \
        SHAPE.bytes_per_token
    for sequence in (sequences[0], sequences[2], again):
        sequence.release()
    assert store.shelves == {} and store.used_bytes == store.held_bytes == 0


def test_a_growing_sequence_moves_shelf_with_its_data_and_new_slots_start_zeroed():
    store = KVStore(SHAPE)
    neighbour, sequence = store.allocate(), store.allocate()
    neighbour.reserve(PAGE_TOKENS)
    sequence.reserve(PAGE_TOKENS)
    data = torch.randn(2, 2, PAGE_TOKENS, 4)
    for layer in range(2):
        sequence.write(layer, 0, data)
    sequence.length = PAGE_TOKENS
    assert torch.count_nonzero(neighbour.kv) == 0  # never written: zeros, not what empty() left there
    sequence.reserve(PAGE_TOKENS + 1)
    assert sequence.capacity == 2 * PAGE_TOKENS and sequence.shelf is store.shelves[2 * PAGE_TOKENS]
    for layer in range(2):
        keys, values = sequence.view(layer, PAGE_TOKENS)
        assert torch.equal(keys, data[0]) and torch.equal(values, data[1])
    assert torch.count_nonzero(sequence.kv[:, :, :, PAGE_TOKENS:]) == 0
    assert list(store.shelves) == [PAGE_TOKENS, 2 * PAGE_TOKENS] and neighbour.slot == 0


def test_a_shelf_made_inside_a_forward_takes_copies_and_writes_outside_one():
    store = KVStore(SHAPE)
    source = store.allocate()
    with torch.inference_mode():  # as a forward makes it
        source.reserve(10)
        source.write(0, 0, torch.ones(2, 2, 10, 4))
        source.length = 10
    copy = store.allocate()
    copy.copy_prefix(source, 8)  # outside inference mode: a request's prefix reuse between steps
    copy.write(1, 8, torch.ones(2, 2, 2, 4))
    assert copy.shelf is source.shelf and torch.equal(copy.view(0, 8)[0], torch.ones(2, 8, 4))


def test_a_dropped_store_frees_its_shelves_without_waiting_for_the_garbage_collector():
    import gc
    import weakref

    gc.disable()
    try:
        store = KVStore(SHAPE)
        sequence = store.allocate()
        sequence.reserve(10)
        tensor = weakref.ref(sequence.shelf.tensor)
        del store, sequence  # no reference cycle between a shelf and its sequences keeps the memory
        assert tensor() is None
    finally:
        gc.enable()
