"""CommittedEvents: what a verify worker appends again to a stream a failover shortened."""

from __future__ import annotations

from verify_worker.committed import KEEP_EVENTS, KEEP_FINISHED_S, CommittedEvents


def test_missing_gives_the_events_from_the_streams_length_on():
    record = CommittedEvents()
    for seq in range(5):
        record.record("r", seq, f"e{seq}".encode())
    assert record.missing("r", 5) == []
    assert record.missing("r", 3) == [(3, b"e3"), (4, b"e4")]
    assert record.missing("unknown", 0) == []


def test_a_loss_beyond_what_is_kept_is_none():
    record = CommittedEvents()
    for seq in range(KEEP_EVENTS + 3):
        record.record("r", seq, b"e")
    assert record.missing("r", 3) is not None and record.missing("r", 2) is None


def test_a_round_committed_again_replaces_the_newer_ones():
    record = CommittedEvents()
    for seq, event in [(0, b"a"), (1, b"b"), (2, b"c"), (1, b"B")]:
        record.record("r", seq, event)
    assert record.missing("r", 0) == [(0, b"a"), (1, b"B")]


def test_finished_and_dropped_requests_are_kept_a_while_then_forgotten():
    record = CommittedEvents()
    record.record("done", 0, b"e")
    record.record("dropped", 0, b"e")
    record.record("live", 0, b"e")
    record.finish("done", now=100.0)
    record.expire(101.0, live={"live"})
    assert sorted(record.tracked()) == ["done", "dropped", "live"]
    record.expire(100.0 + KEEP_FINISHED_S, live={"live"})
    assert record.tracked() == ["dropped", "live"]
    record.expire(101.0 + KEEP_FINISHED_S, live={"live"})
    assert record.tracked() == ["live"]
