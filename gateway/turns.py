"""One admitted request starts its work per event-loop pass, so refusals never queue behind a burst's admissions.

An admitted request's first stretch runs without yielding: its body is parsed and validated, the prompt is
rendered and tokenized, before its first Redis call. When a burst lets hundreds in at once, those stretches
would run back to back in one pass of the loop, and a refusal arriving meanwhile (a few tens of microseconds
of work) would wait for all of them. `Turns` hands out one turn per pass instead: between two admitted
requests' first stretches the loop reads its sockets again and answers the refusals that came in. No
admission is lost or reordered (turns are first come, first served); the admitted requests' own work is
the same, only interleaved.

Single event loop: no locks; every method runs between awaits.
"""

from __future__ import annotations

import asyncio
from collections import deque


class Turns:
    def __init__(self) -> None:
        self._waiting: deque[asyncio.Future] = deque()
        self._scheduled = False

    def __len__(self) -> int:
        return len(self._waiting)

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
        while self._waiting:
            turn = self._waiting.popleft()
            if not turn.done():
                turn.set_result(None)  # its task resumes in the next pass; so does this, for the one after it
                break
        if self._waiting:
            asyncio.get_running_loop().call_soon(self._next)
        else:
            self._scheduled = False
