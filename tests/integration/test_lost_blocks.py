"""A block that no verify worker will ever answer: the draft driver sends it again or ends its session with an
error event, never a stream that waits for the gateway's timeout."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from draft_worker import driver as driver_module
from draft_worker.driver import SessionFailed
from services.models.drafters import DraftSource
from services.protocol import SessionSpec, verify_pool_queue
from services.redis_client import read_events
from tests.conftest import build_tiny_llama
from tests.integration.fleet import VerifyThread, draft_runtime, output_tokens, reference, submit_spec

PROMPT = [5, 9, 13, 2, 40, 41, 7, 7, 30, 12, 5, 9, 13]


@pytest.fixture(scope="module")
def target():
    return build_tiny_llama(0)


@pytest.fixture
def client(redis_url):
    return redis.Redis.from_url(redis_url)


def drive_then_close(runtime, spec: SessionSpec, worker: VerifyThread):
    """The session driven to its end beside `worker`; both closed however it ends."""
    try:
        return runtime.driver.drive(runtime.new_session(spec, []))
    finally:
        runtime.close()
        worker.close()


def test_a_block_whose_taker_died_before_saying_so_is_sent_to_the_pool_again(client, target, monkeypatch):
    """A verify worker pops a session's first block off the pool's queue and is killed before it tells the draft
    (BlockTaken): nobody's heartbeat to watch, and the block is gone from the queue. The driver sees both and
    sends it again; a live worker then serves the session, output as the target's alone."""
    monkeypatch.setattr(driver_module, "UNTAKEN_AFTER_S", 0.3)
    runtime = draft_runtime(client, DraftSource("tiny-draft", target))
    spec = SessionSpec(request_id="lost-start", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True)
    submit_spec(client, spec)
    workers: list[VerifyThread] = []
    taken: list[bytes] = []

    def take_and_die_then_join() -> None:
        item = client.blpop(verify_pool_queue(spec.pool), timeout=30)  # the dying worker's pop
        if item is not None:
            taken.append(item[1])
        workers.append(VerifyThread(client, target))  # a live worker joins the pool

    dying = threading.Thread(target=take_and_die_then_join)
    dying.start()
    try:
        summary = runtime.driver.drive(runtime.new_session(spec, []))
    finally:
        runtime.close()
        dying.join(timeout=30)
        for worker in workers:
            worker.close()
    assert len(taken) == 1  # the first block was lost with its taker ...
    figures = runtime.driver.meter.figures()  # what the heartbeat says of it
    assert figures.failed_over_blocks >= 1 and figures.resent_blocks == 0, figures
    assert summary.finish_reason == "length" and summary.num_output_tokens == 20, summary
    assert output_tokens(client, "lost-start") == reference(target, PROMPT, 20)  # ... and sent again


def test_a_session_no_verify_worker_answers_ends_its_stream_with_an_error(client, target):
    """No verify worker in the pool: the block waits in its queue (not lost, so not sent again) until the verdict
    deadline; the session then fails, and its stream ends with an error event the gateway answers with."""
    runtime = draft_runtime(client, DraftSource("tiny-draft", target))
    runtime.driver.verdict_timeout_s = 1.0
    spec = SessionSpec(request_id="nobody-home", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True)
    submit_spec(client, spec)
    try:
        with pytest.raises(SessionFailed, match="no verify worker answered round 0"):
            runtime.driver.drive(runtime.new_session(spec, []))
    finally:
        runtime.close()
    events = read_events(client, "nobody-home")
    assert events and events[-1].finished and events[-1].finish_reason == "error", events
    assert "no verify worker answered round 0" in events[-1].error
    assert client.llen(verify_pool_queue(spec.pool)) == 2  # the block, never sent twice, and its release


def test_a_block_a_live_worker_dropped_is_sent_to_it_again_and_the_output_is_the_targets(client, target,
                                                                                         monkeypatch):
    """A verify worker that heartbeats but drops one block of a session it holds (a lost message, whatever lost
    it): the draft driver sends that block to the same worker again after RESEND_AFTER_S, instead of waiting out
    the verdict deadline; the worker answers the copy, and the output is the target's alone."""
    monkeypatch.setattr(driver_module, "RESEND_AFTER_S", 0.5)
    runtime = draft_runtime(client, DraftSource("tiny-draft", target))
    runtime.driver.verdict_timeout_s = 20.0
    spec = SessionSpec(request_id="dropped-once", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True)
    submit_spec(client, spec)
    worker = VerifyThread(client, target)
    admit = worker.worker._admit_blocks  # where every popped block goes
    dropped: list[int] = []

    def admit_but_drop_one(arrived):
        kept = []
        for block, pooled in arrived:
            if not dropped and block.round >= 2 and not block.release:
                dropped.append(block.round)
            else:
                kept.append((block, pooled))
        admit(kept)

    worker.worker._admit_blocks = admit_but_drop_one
    summary = drive_then_close(runtime, spec, worker)
    figures = runtime.driver.meter.figures()  # what the heartbeat says of it
    assert len(dropped) == 1 and figures.resent_blocks >= 1 and figures.failed_over_blocks == 0, figures
    assert summary.finish_reason == "length" and summary.num_output_tokens == 20, summary
    assert output_tokens(client, "dropped-once") == reference(target, PROMPT, 20)


def test_a_resent_block_the_worker_still_holds_commits_nothing_twice(client, target, monkeypatch):
    """Every block is sent again while its slow worker still verifies it (each step 0.4 s, resends every 0.1 s):
    the copies are duplicates of the block in hand or of committed rounds, so the output is the target's alone,
    each round in the stream once."""
    monkeypatch.setattr(driver_module, "RESEND_AFTER_S", 0.1)
    monkeypatch.setattr(driver_module, "FAILOVER_AFTER_S", 0.05)  # the heartbeat look that comes first
    monkeypatch.setattr(driver_module, "LIVENESS_EVERY_S", 0.05)  # ... every tick, not once a second
    runtime = draft_runtime(client, DraftSource("tiny-draft", target))
    spec = SessionSpec(request_id="resent-often", prompt_ids=PROMPT, max_new_tokens=12, ignore_eos=True)
    submit_spec(client, spec)
    worker = VerifyThread(client, target, step_s=0.4)
    summary = drive_then_close(runtime, spec, worker)
    assert runtime.driver.meter.resent_blocks >= 2
    assert summary.num_output_tokens == 12, summary
    events = read_events(client, "resent-often")
    assert [event.seq for event in events] == list(range(len(events)))
    assert output_tokens(client, "resent-often") == reference(target, PROMPT, 12)


def test_a_block_still_in_its_busy_workers_queue_is_not_sent_again(client, target, monkeypatch):
    """A live worker that stops taking blocks for 1.5 s (busy elsewhere) while resends are due every 0.5 s: the
    session's block waits in that worker's queue, so it is not lost and no copy goes after it. (Not shorter: a
    block the worker has taken is resent once it is out that long, and one full garbage collection in this
    process, torch and transformers loaded, took 0.2-0.3 s in the middle of the first step here.)"""
    monkeypatch.setattr(driver_module, "RESEND_AFTER_S", 0.5)
    monkeypatch.setattr(driver_module, "FAILOVER_AFTER_S", 0.05)
    monkeypatch.setattr(driver_module, "LIVENESS_EVERY_S", 0.05)  # a look every tick: resends are due often
    runtime = draft_runtime(client, DraftSource("tiny-draft", target))
    spec = SessionSpec(request_id="queued-behind", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True)
    submit_spec(client, spec)
    worker = VerifyThread(client, target)
    pop = worker.worker._pop
    pause = {"until": None, "popped": 0}

    def pop_with_a_pause(timeout_s, min_room=1):
        if pause["until"] is None and pause["popped"] >= 2:  # two blocks in: the next one waits in the queue
            pause["until"] = time.monotonic() + 1.5
        if pause["until"] is not None and time.monotonic() < pause["until"]:
            time.sleep(0.05)
            return []
        raws = pop(timeout_s, min_room)
        pause["popped"] += len(raws)
        return raws

    worker.worker._pop = pop_with_a_pause
    summary = drive_then_close(runtime, spec, worker)
    assert pause["until"] is not None and runtime.driver.meter.resent_blocks == 0
    assert summary.num_output_tokens == 20, summary
    assert output_tokens(client, "queued-behind") == reference(target, PROMPT, 20)
