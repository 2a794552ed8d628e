"""The gateway's front door: admitted requests start one per loop pass once arrivals pause (gateway/admission/turns.py),
and the access log writes one line per answered request and one summary a second for refusals
(gateway/observability/access_log.py)."""

from __future__ import annotations

import asyncio
import logging

from gateway.observability.access_log import REFUSED, AccessLog, RefusalSummary
from gateway.admission.turns import Turns


class PassCounter:
    """Counts event-loop passes: one callback that re-schedules itself each pass."""

    def __init__(self) -> None:
        self.passes = 0
        self.running = True

    def start(self) -> None:
        asyncio.get_running_loop().call_soon(self._tick)

    def _tick(self) -> None:
        self.passes += 1
        if self.running:
            asyncio.get_running_loop().call_soon(self._tick)


def test_turns_are_handed_out_first_come_one_per_loop_pass_and_skip_a_cancelled_waiter():
    async def scenario():
        turns, counter, started = Turns(), PassCounter(), []
        counter.start()

        async def request(name: str) -> None:
            await turns.take()
            started.append((name, counter.passes))

        tasks = {name: asyncio.create_task(request(name)) for name in "abcde"}
        await asyncio.sleep(0)  # every one is waiting now
        tasks["c"].cancel()  # its client left while it waited
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        counter.running = False
        return started, len(turns)

    started, left = asyncio.run(scenario())
    assert [name for name, _ in started] == ["a", "b", "d", "e"]
    passes = [at for _, at in started]
    assert all(later > earlier for earlier, later in zip(passes, passes[1:]))  # never two in one pass
    assert left == 0


def test_turns_let_a_refusal_in_between_two_admitted_requests():
    """A request that arrives (here: is scheduled) after a burst's admissions runs before the last of them."""
    async def scenario():
        turns, order = Turns(), []

        async def admitted(name: str) -> None:
            await turns.take()
            order.append(name)

        async def refused() -> None:
            order.append("refusal")

        tasks = [asyncio.create_task(admitted(f"admitted-{index}")) for index in range(3)]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(refused()))
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(scenario())
    assert order.index("refusal") < order.index("admitted-2")


class Arrivals(PassCounter):
    """Counts passes, and has a request arrive in each of the first `passes` of them (forever with None)."""

    def __init__(self, turns: Turns, passes: int | None) -> None:
        super().__init__()
        self.turns, self.arriving_passes = turns, passes

    def _tick(self) -> None:
        if self.arriving_passes is None or self.passes < self.arriving_passes:
            self.turns.arrived()
        super()._tick()


def granted_passes(arriving_passes: int | None, admitted: int, max_held_passes: int) -> list[int]:
    """The pass each of `admitted` requests got its turn in, while requests arrive in the first passes."""
    async def scenario():
        turns = Turns(max_held_passes=max_held_passes)
        arrivals, granted = Arrivals(turns, arriving_passes), []
        arrivals.start()

        async def request() -> None:
            await turns.take()
            granted.append(arrivals.passes)

        await asyncio.gather(*(request() for _ in range(admitted)))
        arrivals.running = False
        return granted

    return asyncio.run(scenario())


def test_turns_wait_while_requests_keep_arriving_then_go_one_per_pass():
    granted = granted_passes(arriving_passes=10, admitted=3, max_held_passes=16)
    assert granted[0] > 10  # none while the burst's requests were still coming in (and being refused)
    assert granted == sorted(set(granted)) and granted[-1] - granted[0] <= 3


def test_a_steady_stream_of_arrivals_slows_turns_but_never_stops_them():
    granted = granted_passes(arriving_passes=None, admitted=4, max_held_passes=5)
    gaps = [later - earlier for earlier, later in zip(granted, granted[1:])]
    assert granted[0] <= 8 and gaps == [6, 6, 6], granted  # held 5 passes, then one turn: one per 6 passes


def scope(path: str = "/v1/chat/completions", **state) -> dict:
    return {"type": "http", "method": "POST", "path": path, "query_string": b"", "http_version": "1.1",
            "client": ("10.0.0.7", 4242), "headers": [], "state": state}


def test_the_access_log_writes_the_status_and_duration_when_the_response_ends(caplog):
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def refuse(scope, receive, send):
        scope["state"][REFUSED] = True
        await send({"type": "http.response.start", "status": 503, "headers": []})

    async def ignore(message):
        pass

    with caplog.at_level(logging.INFO, logger="gateway.access"):
        asyncio.run(AccessLog(app)(scope(), None, ignore))
        asyncio.run(AccessLog(refuse)(scope(), None, ignore))
    lines = [record.getMessage() for record in caplog.records if record.name == "gateway.access"]
    assert len(lines) == 1, lines  # the refusal is not a line of its own
    assert lines[0].startswith('10.0.0.7:4242 - "POST /v1/chat/completions HTTP/1.1" 201 ') and lines[0].endswith(" ms")


def test_refusals_within_a_second_are_one_line_with_counts_per_status(caplog):
    async def scenario():
        summary = RefusalSummary(every_s=0.05)
        for status in (503, 503, 429, 503):
            summary.count(status)
        await asyncio.sleep(0.1)
        summary.count(503)  # a later run: its own line
        await asyncio.sleep(0.1)

    with caplog.at_level(logging.WARNING, logger="gateway.access"):
        asyncio.run(scenario())
    lines = [record.getMessage() for record in caplog.records if record.name == "gateway.access"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("refused 4 requests in ") and "429 x 1, 503 x 3" in lines[0]
    assert lines[1].startswith("refused 1 requests in ") and "503 x 1" in lines[1]
