"""Continuous batching end to end on tiny models, with a real Redis: a verify worker thread, draft drivers.

Many sessions share target steps (ragged rows, chunked prefill under a token budget, plain-route sessions
running target-only rounds on their own), sessions are evicted and rebuilt mid-flight under a small KV
budget, one driver carries dozens of sessions, and every output is single-stream target-only decoding's.
"""

from __future__ import annotations

import pytest
import torch

from services.config import SchedulerSettings
from services.models.drafters import DraftSource
from services.models.kv_store import PAGE_TOKENS
from services.protocol import SessionSpec
from services.speculative.params import SamplingParams
from tests.conftest import TINY_VOCAB, build_tiny_llama, perturbed_copy
from tests.integration.fleet import empty_redis, output_tokens, reference, running_fleet, submit_spec


@pytest.fixture(scope="module")
def target():
    return build_tiny_llama(0, max_position_embeddings=512)


@pytest.fixture
def client():
    with empty_redis() as connection:
        yield connection


def prompt(seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    length = int(torch.randint(3, 80, (1,), generator=generator))
    ids = torch.randint(0, TINY_VOCAB, (length,), generator=generator).tolist()
    return ids + ids[: length // 3]  # a repeat, so prompt lookup has something to propose


def run_sessions(client, runtime, specs: list[SessionSpec]) -> None:
    for spec in specs:
        submit_spec(client, spec)
    handles = [runtime.driver.submit(runtime.new_session(spec, [])) for spec in specs]
    assert runtime.driver.num_sessions == len(specs)  # all in flight at once in one process
    for handle in handles:
        assert handle.done.wait(120), f"{handle.session.request_id} did not finish"
        assert handle.error is None, handle.error


def test_many_sessions_share_steps_and_decode_exactly(target, client):
    specs = [SessionSpec(request_id=f"b-{n}", prompt_ids=prompt(n), max_new_tokens=24, ignore_eos=True,
                         route="ar" if n % 3 == 0 else "sd") for n in range(24)]
    with running_fleet(client, target, DraftSource("ngram", None),
                       scheduler=SchedulerSettings(max_batch_size=8, max_batch_tokens=40)) as (verify, runtime):
        run_sessions(client, runtime, specs)
    for spec in specs:
        assert output_tokens(client, spec.request_id) == reference(target, spec.prompt_ids, 24), spec.request_id
    stats = verify.worker.figures.counters
    # steps were shared (a step of two rows or more), never over the batch cap; how many rows a step carries
    # is the box's timing (`mirror-sd bench --concurrency`: rows/step)
    assert stats.steps < stats.rows <= 8 * stats.steps


def test_plain_route_runs_target_only_rounds_without_a_round_trip_each(target, client):
    spec = SessionSpec(request_id="plain", prompt_ids=prompt(1), max_new_tokens=150, ignore_eos=True, route="ar")
    with running_fleet(client, target, DraftSource("ngram", None)) as (verify, runtime):
        run_sessions(client, runtime, [spec])
    assert output_tokens(client, "plain") == reference(target, spec.prompt_ids, 150)
    assert runtime.driver.num_verdicts == 3  # blocks of up to 64 target-only rounds: 64 + 64 + 22


def test_sessions_evicted_and_rebuilt_mid_flight_decode_exactly(target, client):
    engine_bytes_per_token = 2 * 2 * 2 * 8 * 4
    budget = 5 * PAGE_TOKENS * engine_bytes_per_token  # room for a few sessions' pages, not for 12
    specs = [SessionSpec(request_id=f"e-{n}", prompt_ids=prompt(100 + n), max_new_tokens=40, ignore_eos=True)
             for n in range(12)]
    with running_fleet(client, target, DraftSource("ngram", None), kv_budget_bytes=budget,
                       scheduler=SchedulerSettings(max_batch_size=4, max_batch_tokens=64)) as (verify, runtime):
        run_sessions(client, runtime, specs)
    assert verify.worker.sessions.num_evictions > 0
    for spec in specs:
        assert output_tokens(client, spec.request_id) == reference(target, spec.prompt_ids, 40), spec.request_id


def test_one_driver_carries_sixty_four_sessions(target, client):
    specs = [SessionSpec(request_id=f"m-{n}", prompt_ids=prompt(200 + n), max_new_tokens=12, ignore_eos=True)
             for n in range(64)]
    with running_fleet(client, target, DraftSource("ngram", None),
                       scheduler=SchedulerSettings(max_batch_size=32)) as (verify, runtime):
        run_sessions(client, runtime, specs)
    for spec in specs[:: 7]:
        assert output_tokens(client, spec.request_id) == reference(target, spec.prompt_ids, 12), spec.request_id
    counters = verify.worker.figures.counters  # steps shared, within the cap (how many: the bench's rows/step)
    assert counters.steps < counters.rows <= 32 * counters.steps


def test_seeded_sampling_is_the_same_batched_as_in_process(target, client):
    """One seeding scheme: round r draws from its own streams wherever it runs."""
    draft = perturbed_copy(target, scale=0.05, seed=4)
    sampling = SamplingParams(temperature=1.0, top_p=0.95, seed=11)
    specs = [SessionSpec(request_id=f"s-{n}", prompt_ids=prompt(300 + n), max_new_tokens=30, ignore_eos=True,
                         sampling=sampling) for n in range(4)]
    with running_fleet(client, target, DraftSource("tiny-draft", draft), pipelined=True) as (verify, runtime):
        run_sessions(client, runtime, specs)
    for spec in specs:
        expected = reference(target, spec.prompt_ids, 30, sampling, DraftSource("tiny-draft", draft).new_drafter())
        assert output_tokens(client, spec.request_id) == expected, spec.request_id


def test_model_drafts_of_many_sessions_step_together(target, client):
    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=6))
    engine = source.new_drafter().draft_engine.engine
    rows_per_forward: list[int] = []
    forward = engine.forward
    engine.forward = lambda rows: (rows_per_forward.append(len(rows)), forward(rows))[1]
    specs = [SessionSpec(request_id=f"d-{n}", prompt_ids=prompt(400 + n), max_new_tokens=30, ignore_eos=True)
             for n in range(8)]
    with running_fleet(client, target, source, pipelined=True) as (verify, runtime):
        run_sessions(client, runtime, specs)
    for spec in specs:
        assert output_tokens(client, spec.request_id) == reference(target, spec.prompt_ids, 30), spec.request_id
    assert max(rows_per_forward) > 1 and sum(rows_per_forward) / len(rows_per_forward) > 1.5
