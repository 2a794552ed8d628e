"""Similarity routing: MinHash LSH over prompt shingles, and which worker may take a similar request."""

import random

from gateway.fleet.routing import Route, choose_affinity
from gateway.fleet.similarity import Similar, SimilarityIndex, shingles
from services.config import MergingSettings
from services.protocol import RoutingTable

rng = random.Random(7)
DOCUMENT = [rng.randrange(49152) for _ in range(1000)]


def index(**settings) -> SimilarityIndex:
    return SimilarityIndex(MergingSettings(**settings))


def test_shingles_are_runs_of_tokens():
    assert shingles([1, 2, 3], 2) == [bytes([1, 0, 0, 0, 2, 0, 0, 0]), bytes([2, 0, 0, 0, 3, 0, 0, 0])]
    assert len(shingles([5], 4)) == 1  # shorter than a shingle: one


def test_the_same_document_with_a_new_question_is_found_an_unrelated_prompt_is_not():
    similar = index()
    similar.add("doc-q1", similar.sketch([*DOCUMENT, 11, 12, 13]))
    similar.note_worker("doc-q1", "verify-0")
    found = similar.most_similar(similar.sketch([*DOCUMENT, 21, 22, 23, 24]))
    assert [item.request_id for item in found] == ["doc-q1"] and found[0].similarity > 0.9
    assert found[0].worker_id == "verify-0"
    unrelated = [rng.randrange(49152) for _ in range(1000)]
    assert similar.most_similar(similar.sketch(unrelated)) == []


def test_a_prompt_whose_worker_is_not_known_yet_is_not_offered():
    similar = index()
    similar.add("fresh", similar.sketch(DOCUMENT))
    assert similar.most_similar(similar.sketch(DOCUMENT)) == []


def test_the_index_forgets_the_oldest_beyond_its_size():
    similar = index(index_size=2)
    for name in ("a", "b", "c"):
        similar.add(name, similar.sketch([*DOCUMENT, ord(name)]))
        similar.note_worker(name, "w")
    assert len(similar) == 2
    assert "a" not in {item.request_id for item in similar.most_similar(similar.sketch(DOCUMENT))}


ROUTE = Route(pool="cpu", route="sd", max_draft_tokens=None, table_version=3)


def test_affinity_skips_dead_and_hot_workers_and_respects_pool_weights():
    similar = [Similar("r1", 0.99, "hot"), Similar("r2", 0.95, "dead"), Similar("r3", 0.9, "gpu-0"),
               Similar("r4", 0.88, "cpu-1")]
    table = RoutingTable(version=3, pool_weights={"cpu": 1.0, "gpu": 1.0}, hot_workers=["hot"])
    pools = {"hot": "cpu", "gpu-0": "gpu", "cpu-1": "cpu"}
    route, chosen = choose_affinity(ROUTE, similar, table=table, verify_pools=pools)
    assert chosen.worker_id == "gpu-0" and route.pool == "gpu"  # the pool moves with the worker
    no_gpu = RoutingTable(version=3, pool_weights={"cpu": 1.0, "gpu": 0.0}, hot_workers=["hot"])
    route, chosen = choose_affinity(ROUTE, similar, table=no_gpu, verify_pools=pools)
    assert chosen.worker_id == "cpu-1" and route == ROUTE  # a pool without traffic is not used for affinity
    route, chosen = choose_affinity(ROUTE, similar[:2], table=table, verify_pools=pools)
    assert chosen is None and route == ROUTE


def test_a_similar_prompt_of_another_cache_salt_is_not_offered():
    similar = index()
    similar.add("salted", similar.sketch(DOCUMENT), "tenant-a")
    similar.note_worker("salted", "verify-0")
    assert similar.most_similar(similar.sketch(DOCUMENT)) == []
    assert [item.request_id for item in similar.most_similar(similar.sketch(DOCUMENT), salt="tenant-a")] == ["salted"]
