"""The load a step's verdicts tell remote drafts: what the next block meets, not what the step began with.

A remote draft decides its next block from its last verdict: the rows there (Verdict.batch_rows) and this worker's
word at a load (Verdict.load_arm, verify_worker/load_word.py). Both used to be the step's own: its rows, the
sessions held when it began. At a burst's start they are one: its first request is prefilled alone, while the rest
of the burst comes in during that step. Its draft heard "one row", drafted (prefill, then blocks) while the verify
worker, now holding every session of the burst, took the draft to be idle and ran the next prefill step on both
cores beside it: 1649 ms where such steps took 268-392 (docs/bench/turns-2026-12-06, section 5). The other
requests' first tokens came seconds late.

So a step's verdicts tell the rows its next steps will have: its own, and every opening on its way to them, those
held here whose opening round has not run yet and the new sessions queued during the step (popped before the
verdicts go out: blocks, not a guess from a queue's length). The word is the one at the sessions held plus those
queued. Between bursts nothing changes: no opening waits, the rows are the step's.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.protocol import DraftBlock
from verify_worker.sessions import VerifySession


def openings_waiting(held: Iterable[VerifySession], stepped: set[str]) -> int:
    """Sessions held here, not in this step, whose opening round (round 0, target-only) has not run yet."""
    return sum(1 for session in held if session.request_id not in stepped and session.block is not None
               and session.block.round == 0 and not session.first_round_done and not session.target.finished)


def new_sessions(arriving: Iterable[DraftBlock], held: Iterable[str]) -> int:
    """Requests among the blocks queued during a step that this worker does not hold yet (each a session to be)."""
    known = set(held)
    return len({block.request_id for block in arriving if not block.release and block.request_id not in known})


def told_rows(step_rows: int, waiting: int, arriving: int, max_rows: int) -> int:
    """The rows a step's verdicts say the next block meets: the step's, and each opening waiting here or queued,
    up to the rows one step takes (scheduler.max_batch_size: the rest wait for later steps)."""
    return max(step_rows, min(max_rows, step_rows + waiting + arriving))
