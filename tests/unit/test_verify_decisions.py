"""The verify loop's decisions (verify_worker/decisions.py), on sessions described in memory: no Redis, no
model. Each function reads only the session attributes set here."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.config import SchedulerSettings
from services.protocol import DraftBlock
from verify_worker import decisions
from verify_worker.decisions import Placement, ThreadChoice, place


def session(*, block=None, has_work=None, bridging=False, due_in=0.0, finished=False, local=None, streaming=True,
            last_verdict_at=0.0, round_index=0, num_committed=4, bridged=None, **extra):
    """A stand-in VerifySession: has_work defaults to holding a block or bridging (as the real one)."""
    target = SimpleNamespace(finished=finished, streaming=streaming, num_committed=num_committed)
    return SimpleNamespace(
        block=block, has_work=(block is not None or bridging) and not finished if has_work is None else has_work,
        bridging=bridging, bridge_wait=lambda step_s, now=None: due_in, target=target, local=local,
        last_verdict_at=last_verdict_at, round=round_index, bridged_since=lambda _block: bridged, **extra)


def block(round_index=0, num_committed=4, **fields) -> DraftBlock:
    return DraftBlock(request_id="r", round=round_index, num_committed=num_committed, draft_ids=[], **fields)


def test_rows_ready_are_the_blocks_in_hand_with_every_bridge_else_only_the_bridges_due():
    holding, due, later = session(block=block()), session(bridging=True), session(bridging=True, due_in=0.01)
    idle = session()
    assert decisions.ready([holding, due, later, idle], 0.02) == [holding, due, later]  # the step runs anyway
    assert decisions.ready([due, later, idle], 0.02) == [due]
    assert decisions.ready([idle], None) == []
    assert decisions.bridge_wait([due, later, idle], 0.02) == 0.0
    assert decisions.bridge_wait([later, idle], 0.02) == 0.01
    assert decisions.bridge_wait([idle], 0.02) == float("inf")


def test_the_intake_blocks_only_when_nothing_can_run_and_no_longer_than_the_first_bridge_or_the_poll():
    nothing = dict(carried=False, ready_now=False, local_now=False)
    assert decisions.pop_timeout(**nothing, poll_s=0.5, bridge_s=float("inf")) == 0.5
    assert decisions.pop_timeout(**nothing, poll_s=0.5, bridge_s=0.004) == 0.004
    for busy in ("carried", "ready_now", "local_now"):
        assert decisions.pop_timeout(**{**nothing, busy: True}, poll_s=0.5, bridge_s=1.0) == 0.0


def test_local_sessions_between_rounds_are_due_and_recent_verdicts_expect_a_block():
    drafted_here = object()
    between = session(local=drafted_here)
    holding = session(local=drafted_here, block=block())
    done = session(local=drafted_here, finished=True)
    remote = session()
    assert decisions.local_due([between, holding, done, remote]) == [between]
    recent, old = session(last_verdict_at=99.0), session(last_verdict_at=90.0)
    assert decisions.expected([recent, old, holding, session(last_verdict_at=99.5, finished=True)], now=100.0) == 1


def test_the_token_budget_is_the_streaming_one_while_any_stream_runs():
    scheduler = SchedulerSettings(max_batch_tokens=128, prefill_only_batch_tokens=512)
    assert decisions.step_tokens([session(streaming=False), session(streaming=True)], scheduler) == 128
    assert decisions.step_tokens([session(streaming=False)], scheduler) == 512
    assert decisions.step_tokens([session(streaming=True, finished=True)], scheduler) == 512


@pytest.mark.parametrize("num_tokens, drafting, busy, wide", [
    (16, False, False, True),
    (15, False, False, False),
    (4, False, False, False),
    (16, True, False, True),
    (64, True, True, False),  # a draft worker drafts on the other core: never wide
])
def test_a_step_runs_wide_from_its_tokens_unless_a_draft_is_busy(num_tokens, drafting, busy, wide):
    choice = ThreadChoice(threads=1, wide=2, wide_min_tokens=16, plain_wide_min_tokens=16)
    assert choice.wide_step(num_tokens, drafting=drafting, busy=busy) is wide
    assert choice.threads_for(wide) == (2 if wide else 1)


def test_with_no_draft_drafting_a_smaller_step_runs_wide_and_a_worker_without_wide_threads_never_does():
    choice = ThreadChoice(threads=1, wide=2, wide_min_tokens=16, plain_wide_min_tokens=2)
    assert choice.wide_step(2, drafting=False, busy=False) and not choice.wide_step(2, drafting=True, busy=False)
    assert not ThreadChoice(2, None, 16, 2).wide_step(512, drafting=False, busy=False)
    assert not ThreadChoice(2, 2, 16, 2).wide_step(512, drafting=False, busy=False)  # nothing wider to go to


def test_a_draft_waiting_on_a_call_its_word_made_plain_or_an_opening_told_plain_is_not_busy():
    drafting = session(keeps_a_draft_busy=True, awaits_draft_call=False, opens_told_plain=lambda word: False)
    waiting = session(keeps_a_draft_busy=True, awaits_draft_call=True, opens_told_plain=lambda word: False)
    opening = session(keeps_a_draft_busy=True, awaits_draft_call=False, opens_told_plain=lambda word: word == "plain")
    idle = session(keeps_a_draft_busy=False, awaits_draft_call=False, opens_told_plain=lambda word: False)
    remote = [drafting, waiting, opening, idle]
    assert decisions.busy_drafts(remote, waits_idle=False, last_word="") == [True, True, True, False]
    assert decisions.busy_drafts(remote, waits_idle=True, last_word="plain") == [True, False, False, False]


def test_a_queued_block_is_placed_by_what_the_session_held_here_is_in():
    assert place(block(draft_here=True), session()) == (Placement.SECOND_START, None)
    assert place(block(draft_here=True), None) == (Placement.REBUILD, None)  # a start: the session is built
    assert place(block(release=True), session()) == (Placement.RELEASE, None)
    assert place(block(parent_id=3), session()) == (Placement.CHAINED, None)
    assert place(block(), None) == (Placement.REBUILD, None)
    in_hand = block(round_index=2)
    assert place(block(round_index=2), session(block=in_hand)) == (Placement.DUPLICATE, None)
    assert place(block(round_index=2), session(bridging=True, bridged=3)) == (Placement.BRIDGED, 3)
    assert place(block(round_index=2, num_committed=9), session(round_index=2, num_committed=9)) == (Placement.TAKE, None)
    # stale (an earlier round), or ahead of what is held: checked against the stream
    assert place(block(round_index=1, num_committed=9), session(round_index=2, num_committed=9))[0] is Placement.REBUILD
    assert place(block(round_index=2, num_committed=8), session(round_index=2, num_committed=9))[0] is Placement.REBUILD
    assert place(block(round_index=2), session(bridging=True, bridged=None, round_index=5))[0] is Placement.REBUILD
