"""OutputCursor: each output token reaches the client once, whatever a failover made the stream repeat."""

from __future__ import annotations

import pytest

from gateway.errors import RequestLost
from gateway.streams.reader import OutputCursor
from services.protocol import OutputEvent


def event(seq: int, tokens: list[int], total: int, **extra) -> OutputEvent:
    return OutputEvent(request_id="r", seq=seq, token_ids=tokens, num_output_tokens=total, **extra)


def read(cursor: OutputCursor, events: list[OutputEvent]) -> list[int]:
    taken = []
    for item in events:
        admitted = cursor.admit(item)
        if admitted is not None:
            taken.extend(admitted.token_ids)
    return taken


def test_a_stream_read_once_passes_unchanged():
    events = [event(0, [1, 2], 2), event(1, [3], 3), event(2, [4, 5], 5, finished=True)]
    cursor = OutputCursor()
    assert [cursor.admit(item) for item in events] == events
    assert cursor.num_tokens == 5


def test_rounds_committed_again_after_a_failover_are_skipped():
    """Read from the start again: the events before the loss, then the lost round committed once more."""
    cursor = OutputCursor()
    first = [event(0, [1, 2], 2), event(1, [3, 4], 4), event(2, [5], 5)]
    again = [event(0, [1, 2], 2), event(1, [3, 4], 4), event(2, [5], 5), event(3, [6], 6, finished=True)]
    assert read(cursor, first) + read(cursor, again) == [1, 2, 3, 4, 5, 6]


def test_a_rebuilt_session_cutting_its_rounds_otherwise_gives_only_the_new_tokens():
    cursor = OutputCursor()
    assert read(cursor, [event(0, [1, 2], 2), event(1, [3, 4, 5], 5)]) == [1, 2, 3, 4, 5]
    # round 1 was lost; the rebuilt session committed [3] then [4, 5, 6]
    assert read(cursor, [event(0, [1, 2], 2), event(1, [3], 3), event(2, [4, 5, 6], 6)]) == [6]
    trimmed = cursor.admit(event(3, [6, 7], 7, finished=True))
    assert trimmed.token_ids == [7] and trimmed.finished and trimmed.seq == 3


def test_a_finished_event_is_yielded_even_when_it_repeats_its_tokens():
    cursor = OutputCursor()
    read(cursor, [event(0, [1, 2], 2)])
    final = cursor.admit(event(0, [1, 2], 2, finished=True, finish_reason="stop"))
    assert final is not None and final.token_ids == [] and final.finish_reason == "stop"


def test_events_without_tokens_pass():
    cursor = OutputCursor()
    read(cursor, [event(0, [1], 1)])
    error = cursor.admit(event(1, [], 1, finished=True, finish_reason="error", error="boom"))
    assert error is not None and error.error == "boom"


def test_a_stream_that_skips_tokens_is_lost_not_served_with_a_hole():
    cursor = OutputCursor()
    read(cursor, [event(0, [1, 2], 2)])
    with pytest.raises(RequestLost, match="skips tokens 2..3"):
        cursor.admit(event(2, [5], 5))
