"""Admitted requests start their work one per event-loop pass, and only in a pass where no new request came
in, so refusals never queue behind a burst's admissions.

An admitted request's first stretch runs without yielding: its body is parsed and validated, the prompt is
rendered and tokenized, before its first Redis call; after it come the Redis calls, the task sent to the
draft workers, the stream. When a burst lets hundreds in at once, those stretches would run back to back in
one pass of the loop, and a refusal arriving meanwhile (a few tens of microseconds of work) would wait for
all of them. `Turns` hands out one turn per pass instead, and holds the next one back while requests are
still arriving (the front door calls `arrived()` for each): a burst's refusals are all answered first, then
the admitted requests go. A turn is held back at most `max_held_passes` passes in a row, so a steady stream
of arrivals slows admitted requests' start but never stops it. No admission is lost or reordered (turns are
first come, first served); the admitted requests' own work is the same, only later by the burst's length.

Single event loop: no locks; every method runs between awaits.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Turns:
    def __init__(self, max_held_passes: int = 16) -> None:
        self.max_held_passes = max_held_passes
        self._waiting: deque[asyncio.Future] = deque()
        self._scheduled = False
        self._arrivals = 0  # request heads the front door has seen
        self._arrivals_seen = 0  # ... as of the last pass a turn was considered in
        self._held = 0  # passes in a row a turn was held back

    def __len__(self) -> int:
        return len(self._waiting)

    def arrived(self) -> None:
        """A request came in (refused or admitted): while they keep coming, turns wait."""
        self._arrivals += 1

    async def take(self) -> None:
        """Wait for this request's turn: at the earliest the next pass of the loop, after the one before it."""
        loop = asyncio.get_running_loop()
        turn = loop.create_future()
        self._waiting.append(turn)
        if not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._next)
        await turn  # a cancelled waiter (its client left) is skipped by _next

    def _next(self) -> None:
        arriving = self._arrivals != self._arrivals_seen
        self._arrivals_seen = self._arrivals
        if arriving and self._held < self.max_held_passes:
            self._held += 1  # the refusals of this pass go first
        else:
            self._held = 0
            while self._waiting:
                turn = self._waiting.popleft()
                if not turn.done():
                    turn.set_result(None)  # its task resumes in the next pass; so does this, for the one after
                    break
        if self._waiting:
            asyncio.get_running_loop().call_soon(self._next)
        else:
            self._scheduled = False
