"""A draft task's start (draft_worker/runtime.py): the request's spec, its lease and its output so far in one
round trip (services/redis_client.py, open_session), so that over a slow link the draft begins to prefill one
trip after the task arrived, not four or six."""

from __future__ import annotations

import os
import threading
import time

import pytest
import redis

from services import protocol
from services.link.meter import TRIP_BLOCKS, TRIP_FINISH, TRIP_LEASE, TRIP_LOOK, TRIP_OPEN
from services.models.drafters import DraftSource
from services.protocol import BlockTaken, OutputEvent, SessionSpec, Verdict
from services.redis_client import open_session, read_events
from tests.conftest import build_tiny_llama, perturbed_copy
from tests.integration.fleet import VerifyThread, behind_link, draft_runtime, output_tokens, reference, submit_spec

PROMPT = [5, 9, 13, 2, 40, 41, 7, 7, 30, 12, 5, 9, 13]
RTT_MS = 300  # large against a tiny model's drafting, so that the trips before the first block are what shows


@pytest.fixture(scope="module")
def target():
    return build_tiny_llama(0)


def test_open_session_takes_a_free_lease_and_names_its_owner_in_one_call(redis_url):
    client = redis.Redis.from_url(redis_url)
    me, other = protocol.instance_id("draft-a", os.getpid()), protocol.instance_id("draft-b", 4_000_001)
    assert open_session(client, "start-none", me, 10).spec is None  # no such request: nothing taken
    assert client.get(protocol.lease_key("start-none")) is None

    spec = SessionSpec(request_id="start-free", prompt_ids=PROMPT, max_new_tokens=4)
    submit_spec(client, spec)
    event = OutputEvent(request_id=spec.request_id, seq=0, token_ids=[7], num_output_tokens=1)
    client.xadd(protocol.output_stream(spec.request_id), {"m": event.encode()})
    opened = open_session(client, spec.request_id, me, 10)
    assert opened.leased and SessionSpec.decode(opened.spec) == spec
    assert [e.token_ids for e in opened.events] == [[7]] and opened.events == read_events(client, spec.request_id)
    assert client.get(protocol.lease_key(spec.request_id)) == me.encode()
    assert client.get(protocol.owner_key(spec.request_id)) == me.encode()
    assert 0 < client.ttl(protocol.lease_key(spec.request_id)) <= 10

    assert opened.opening is None  # nothing answered on the request's own list
    again = open_session(client, spec.request_id, other, 10)  # a live owner holds it: taken from nobody
    assert not again.leased and again.events == opened.events
    assert client.get(protocol.lease_key(spec.request_id)) == me.encode()
    assert client.get(protocol.owner_key(spec.request_id)) == me.encode()


def test_open_session_brings_the_opening_verdict_answered_before_the_session_started(redis_url):
    """SessionSpec.opened: round 0's BlockTaken note and verdict go to the request's own list; a session that
    starts after them reads the verdict in the same call, for the load its verify worker told."""
    client = redis.Redis.from_url(redis_url)
    spec = SessionSpec(request_id="start-opened", prompt_ids=PROMPT, max_new_tokens=4, opened=True)
    submit_spec(client, spec)
    verdict = Verdict(request_id=spec.request_id, round=0, num_committed=len(PROMPT) + 1, num_draft_tokens=0,
                      num_accepted=0, committed_ids=[7], batch_rows=9, load_arm="plain", worker_id="verify-w")
    resync = Verdict(request_id=spec.request_id, round=0, num_committed=len(PROMPT) + 1, num_draft_tokens=0,
                     num_accepted=0, committed_ids=[7], worker_id="")  # round 0 sent again: answered from the stream
    client.rpush(protocol.verdict_queue(spec.request_id), BlockTaken(spec.request_id, 0, "verify-w").encode(),
                 verdict.encode(), b"not a message", resync.encode())
    opened = open_session(client, spec.request_id, protocol.instance_id("draft-a", os.getpid()), 10)
    assert opened.leased and opened.opening == verdict


def test_a_draft_task_sends_its_first_block_one_link_trip_after_it_starts(target, redis_url):
    """Behind a 300 ms link, with its pool's costs already read (a running worker's second session on): the first
    block goes out after one round trip, the open, and not before the link's delay. The start used to be four
    trips one after another (spec, lease, owner, output) and a read of the heartbeats when the cost cache was 10 s
    old. Counted, not timed: how long the tiny draft's prefill takes is the box's business."""
    from draft_worker.runtime import drive_session

    client = redis.Redis.from_url(redis_url)
    verify = VerifyThread(client, target, load_word=False)
    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    spec = SessionSpec(request_id="start-linked", prompt_ids=PROMPT, max_new_tokens=12, ignore_eos=True)
    submit_spec(client, spec)
    first_sent = []
    try:
        with behind_link(client, RTT_MS) as linked:
            runtime = draft_runtime(linked, source, pipelined=True, block_policy="cost")
            try:
                assert runtime.cost_model(spec.pool) is not None  # read once, then cached
                result = {}
                started = time.perf_counter()
                driving = threading.Thread(target=lambda: result.update(drive_session(runtime, spec.request_id)))
                driving.start()
                while driving.is_alive() and not first_sent:
                    handles = list(runtime.driver._handles.values())
                    flight = handles[0].session.in_flight if handles else None
                    if flight is not None:
                        first_sent.append(flight.sent_at)
                        with runtime.driver.meter._lock:  # the block's own push may be counted already
                            before_first = dict(runtime.driver.meter._round_trips)
                    time.sleep(0.002)
                driving.join(60)
                trips = dict(runtime.driver.meter._round_trips)
            finally:
                runtime.close()
    finally:
        verify.close()
    assert result["finish_reason"] == "length"
    assert output_tokens(client, spec.request_id) == reference(target, PROMPT, 12)
    assert first_sent and first_sent[0] - started >= RTT_MS / 1000, first_sent[0] - started  # the open's trip
    # the open is the one trip of the start before the first block; the periodic ones come only with time (a
    # cancellation look alone after a second without blocks, the lease renewed every 2.5 s): a slow box's prefill
    periodic = {TRIP_LOOK, TRIP_LEASE}
    assert before_first.get(TRIP_OPEN) == 1 and set(before_first) <= {TRIP_OPEN, TRIP_BLOCKS} | periodic, before_first
    assert trips[TRIP_OPEN] == 1 and trips[TRIP_FINISH] == 1  # and the lease was given back with the figures
    assert client.get(protocol.lease_key(spec.request_id)) is None


def test_a_task_waits_while_a_live_owner_holds_the_lease_and_ends_when_the_request_has(target, redis_url):
    """A redelivered task whose request another process drives: it looks again every half second (one trip
    each) and returns once the output is finished, never taking the lease from the live owner."""
    from draft_worker.runtime import drive_session

    client = redis.Redis.from_url(redis_url)
    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    spec = SessionSpec(request_id="start-held", prompt_ids=PROMPT, max_new_tokens=1)
    submit_spec(client, spec)
    owner = protocol.instance_id("draft-b", 4_000_001)
    client.set(protocol.lease_key(spec.request_id), owner, ex=30)
    runtime = draft_runtime(client, source)
    try:
        result = {}
        driving = threading.Thread(target=lambda: result.update(drive_session(runtime, spec.request_id)))
        driving.start()
        time.sleep(1.2)
        assert driving.is_alive()  # waiting on the owner
        finished = OutputEvent(request_id=spec.request_id, seq=0, token_ids=[7], num_output_tokens=1,
                               finished=True, finish_reason="length")
        client.xadd(protocol.output_stream(spec.request_id), {"m": finished.encode()})
        driving.join(5)
        assert not driving.is_alive() and result["finish_reason"] == "already_finished"
        assert runtime.driver.meter._round_trips[TRIP_OPEN] >= 3
    finally:
        runtime.close()
    assert client.get(protocol.lease_key(spec.request_id)) == owner.encode()


def test_a_task_that_finds_its_request_finished_closes_the_row_its_driver_left_open(target, redis_url, tmp_path):
    """A killed draft worker's task comes back after the verify worker finished the session on its own: the row
    still says running, and the task closes it from the stream's last event. A closed row stays as written."""
    from draft_worker.runtime import drive_session
    from services.storage import crud
    from services.storage.db import init_db, session_factory

    client = redis.Redis.from_url(redis_url)
    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    runtime = draft_runtime(client, source)
    runtime.db = session_factory(init_db(f"sqlite:///{tmp_path / 'rows.db'}"))
    try:
        for request_id, status in (("ended-open", "running"), ("ended-closed", "finished")):
            submit_spec(client, SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=4))
            with runtime.db() as session:
                crud.create_request(session=session, request_id=request_id, model="tiny", endpoint="chat",
                                    prompt_tokens=len(PROMPT), params={}, priority="normal", route="sd", pool="cpu",
                                    api_key_id=None)
                crud.update_request(session=session, request_id=request_id, status=status, completion_tokens=2)
            last = OutputEvent(request_id=request_id, seq=0, token_ids=[7, 8, 9], num_output_tokens=3,
                               finished=True, finish_reason="stop")
            client.xadd(protocol.output_stream(request_id), {"m": last.encode()})
            assert drive_session(runtime, request_id)["finish_reason"] == "stop"
        with runtime.db() as session:
            opened, closed = (crud.get_request(session=session, request_id=r) for r in ("ended-open", "ended-closed"))
            assert (opened.status, opened.finish_reason, opened.completion_tokens) == ("finished", "stop", 3)
            assert opened.finished_at is not None and opened.recorded_by == crud.RECORDED_BY_STREAM
            assert (closed.status, closed.completion_tokens, closed.recorded_by) == ("finished", 2, None)
    finally:
        runtime.close()
