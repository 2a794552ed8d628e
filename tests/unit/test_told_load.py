"""What a step's verdicts tell remote drafts about the load: verify_worker/told_load.py."""

from services.protocol import DraftBlock
from verify_worker.told_load import new_sessions, told_rows


def block(request_id: str, round_index: int = 0, **fields) -> DraftBlock:
    return DraftBlock(request_id=request_id, round=round_index, num_committed=4, draft_ids=[], **fields)


def test_a_queued_block_is_a_new_session_once_per_request_unless_held_or_a_release():
    arriving = [block("a"), block("b"), block("b", 1), block("c", release=True), block("held", 3)]
    assert new_sessions(arriving, ["held"]) == 2
    assert new_sessions([], ["held"]) == 0


def test_the_rows_told_are_the_steps_and_every_opening_on_its_way_up_to_a_steps_rows():
    assert told_rows(1, 0, 7, max_rows=32) == 8
    assert told_rows(4, 12, 0, max_rows=32) == 16
    assert told_rows(3, 0, 0, max_rows=32) == 3
    assert told_rows(4, 30, 10, max_rows=32) == 32  # a burst larger than a step: the rest wait for later steps
