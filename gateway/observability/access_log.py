"""The gateway's access log: one line per answered request, written when its response has ended, with its
status and duration; early refusals (gateway/admission/front_door.py) are counted, not logged one by one.

uvicorn's own access line is off (`mirror-sd gateway`): it is written as a response starts, so a stream's
line tells neither how long it ran nor how it ended, and in a burst of refusals, formatting and writing a
line for each would be most of what a refusal costs. Here, refusals within a second are one warning
("refused 770 requests in 1.0 s: 503 x 770"), and every other request one info line naming its request id
(the route binds it: services/logs.py), e.g. `127.0.0.1:51234 - "POST /v1/chat/completions HTTP/1.1" 200 812 ms`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

logger = logging.getLogger("gateway.access")

REFUSED = "early_refusal"  # set in scope["state"] by the admission layer when it answered the request itself
SUMMARY_EVERY_S = 1.0


class RefusalSummary:
    """Counts refusals; a second after the first of a run, one line with the counts per status."""

    def __init__(self, every_s: float = SUMMARY_EVERY_S) -> None:
        self.every_s = every_s
        self.counts: Counter[int] = Counter()
        self._since = 0.0

    def count(self, status: int) -> None:
        if not self.counts:
            self._since = time.monotonic()
            asyncio.get_running_loop().call_later(self.every_s, self.flush)
        self.counts[status] += 1

    def flush(self) -> None:
        if self.counts:
            statuses = ", ".join(f"{status} x {n}" for status, n in sorted(self.counts.items()))
            logger.warning("refused %d requests in %.1f s: %s (at capacity, draining or a key over its limit; "
                           "each answered with Retry-After)", sum(self.counts.values()),
                           time.monotonic() - self._since, statuses)
            self.counts.clear()


class AccessLog:
    """ASGI layer: the access line of every HTTP request but the early refusals."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = 0

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            if not scope.get("state", {}).get(REFUSED) and logger.isEnabledFor(logging.INFO):
                client = scope.get("client")
                query = scope.get("query_string", b"")
                path = scope["path"] + ("?" + query.decode("latin-1") if query else "")
                logger.info('%s - "%s %s HTTP/%s" %s %.0f ms', f"{client[0]}:{client[1]}" if client else "-",
                            scope["method"], path, scope.get("http_version", "1.1"),
                            status or "(no response)", 1000 * (time.perf_counter() - started))
