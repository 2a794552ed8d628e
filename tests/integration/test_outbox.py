"""The draft worker's outbox against a real Redis: jobs handed over while a pipeline is out go in the next
one together, in order, each with its own replies, applied on the taker's thread."""

from __future__ import annotations

import threading

import pytest

from draft_worker.outbox import Job, Outbox
from tests.integration.fleet import empty_redis


@pytest.fixture
def client():
    with empty_redis() as connection:
        yield connection


def test_jobs_handed_over_during_a_round_trip_go_in_one_pipeline_in_order(client):
    client.set("present", 1)
    wake, stopping, out, released = threading.Event(), threading.Event(), threading.Event(), threading.Event()
    kinds, applied = [], []
    outbox = Outbox(client, wake, stopping, kinds.append)
    execute, batches = outbox._execute, []

    def slow_first(jobs):  # the first pipeline stays out (a slow link) until three more jobs are handed over
        batches.append(len(jobs))
        if len(batches) == 1:
            out.set()
            released.wait(5)
        return execute(jobs)

    outbox._execute = slow_first
    outbox.start()
    try:
        outbox.send(Job([("q", b"1")]))
        assert out.wait(5)
        outbox.send(Job([("q", b"2"), ("q", b"3")], reads=[("EXISTS", "present")]))
        outbox.send(Job([("q", b"4")], reads=[("EXISTS", "absent"), ("EXISTS", "present")]),
                    Job(reads=[("LPOS", "q", b"3")], on_replies=applied.extend))
        outbox.send(Job([("other", b"5")]))
        released.set()
        outbox.flush()
        assert batches == [1, 4]
        assert client.lrange("q", 0, -1) == [b"1", b"2", b"3", b"4"] and client.lrange("other", 0, -1) == [b"5"]
        assert kinds == ["blocks", "blocks"]
        outcomes = outbox.outcomes()
        assert [len(outcome.job.pushes) for outcome in outcomes] == [1, 2, 1, 0, 1]
        assert [outcome.replies for outcome in outcomes] == [[], [1], [0, 1], [2], []]
        assert all(outcome.error is None for outcome in outcomes) and wake.is_set()
        assert applied == []  # replies are applied by whoever takes the outcomes (the driver's thread)
        for outcome in outcomes:
            outcome.apply()
        assert applied == [2]
        outbox.send(Job(reads=[("EXISTS", "present")], alone="liveness"))
        outbox.flush()
        assert kinds[-1] == "liveness"  # a pipeline of reads alone counts as what its first job says
    finally:
        stopping.set()
        released.set()
