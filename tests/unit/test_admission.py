"""Admission slots: tier shares, the bounded wait queue in tier order, per-key 429, drain."""

from __future__ import annotations

import asyncio

import pytest

from gateway.admission.slots import Admission, Rejected, tier_limit


def run(coro):
    return asyncio.run(coro)


def test_tier_limits_keep_the_last_slots_for_higher_tiers():
    assert [tier_limit(10, share) for share in (1.0, 0.9, 0.75)] == [10, 9, 7]
    assert tier_limit(1, 0.5) == 1  # never zero: every tier can be served on an idle server


def test_full_tier_with_no_queue_is_rejected_at_once_with_503():
    async def scenario():
        admission = Admission(max_inflight=4, queue_limit=0)
        tickets = [await admission.acquire("low") for _ in range(3)]
        with pytest.raises(Rejected) as low:
            await admission.acquire("low")
        high = await admission.acquire("high")  # the slot low may not take
        assert admission.inflight == 4
        with pytest.raises(Rejected):
            await admission.acquire("high")
        return low.value, tickets, high

    rejected, _, _ = run(scenario())
    assert rejected.status_code == 503 and rejected.retry_after_s >= 1 and "capacity" in rejected.message


def test_waiting_requests_are_granted_in_tier_order_then_arrival_order():
    async def scenario():
        admission = Admission(max_inflight=1, queue_limit=8, queue_timeout_s=5)
        first = await admission.acquire("normal")
        order: list[str] = []

        async def wait(name: str, tier: str):
            ticket = await admission.acquire(tier)
            order.append(name)
            await asyncio.sleep(0)
            admission.release(ticket)

        tasks = [asyncio.create_task(wait(name, tier)) for name, tier in
                 (("low-1", "low"), ("normal-1", "normal"), ("high-1", "high"), ("normal-2", "normal"))]
        await asyncio.sleep(0.01)
        assert admission.queued == 4
        admission.release(first)
        await asyncio.gather(*tasks)
        return order, admission

    order, admission = run(scenario())
    assert order == ["high-1", "normal-1", "normal-2", "low-1"]
    assert admission.inflight == 0 and admission.queued == 0


def test_a_wait_that_runs_out_is_a_503_and_leaves_no_slot_behind():
    async def scenario():
        admission = Admission(max_inflight=1, queue_limit=4, queue_timeout_s=0.05)
        held = await admission.acquire("normal")
        with pytest.raises(Rejected):
            await admission.acquire("normal")
        assert admission.queued == 0
        admission.release(held)
        admission.release(held)  # idempotent
        return admission

    admission = run(scenario())
    assert admission.inflight == 0


def test_a_full_queue_rejects_without_waiting():
    async def scenario():
        admission = Admission(max_inflight=1, queue_limit=1, queue_timeout_s=5)
        await admission.acquire("normal")
        waiter = asyncio.create_task(admission.acquire("normal"))
        await asyncio.sleep(0.01)
        attempt = admission.acquire("normal")
        with pytest.raises(Rejected):
            attempt.send(None)  # refused on its first step: it never suspends, so it waits for nothing
        waiter.cancel()

    run(scenario())


def test_a_key_over_its_own_limit_gets_429_while_others_are_served():
    async def scenario():
        admission = Admission(max_inflight=10, max_inflight_per_key=2)
        tickets = [await admission.acquire("normal", key=7) for _ in range(2)]
        with pytest.raises(Rejected) as over:
            await admission.acquire("normal", key=7)
        await admission.acquire("normal", key=8)
        admission.release(tickets[0])
        again = await admission.acquire("normal", key=7)
        return over.value, again

    over, again = run(scenario())
    assert over.status_code == 429 and "in flight" in over.message and again is not None


def test_drain_refuses_new_requests_and_answers_the_waiting_ones():
    async def scenario():
        admission = Admission(max_inflight=1, queue_limit=4, queue_timeout_s=5)
        held = await admission.acquire("normal")
        waiter = asyncio.create_task(admission.acquire("high"))
        await asyncio.sleep(0.01)
        admission.drain()
        with pytest.raises(Rejected) as waited:
            await waiter
        with pytest.raises(Rejected) as new:
            await admission.acquire("high")
        admission.release(held)
        return waited.value, new.value, admission

    waited, new, admission = run(scenario())
    assert waited.status_code == new.status_code == 503 and "shutting down" in new.message
    assert admission.inflight == 0


def test_a_cancelled_waiter_leaves_the_queue():
    async def scenario():
        admission = Admission(max_inflight=1, queue_limit=4, queue_timeout_s=5)
        held = await admission.acquire("normal")
        waiter = asyncio.create_task(admission.acquire("normal"))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        admission.release(held)
        return admission

    admission = run(scenario())
    assert admission.queued == 0 and admission.inflight == 0


def test_the_early_layer_admits_or_refuses_before_the_body_is_read():
    """gateway/admission/front_door.py: a known caller's slot is taken from the headers alone; a refusal never
    reaches the app; the slot is back once the app has answered."""
    import json
    from types import SimpleNamespace

    from gateway.admission.front_door import TICKET, EarlyAdmission
    from services.config import Settings

    admission = Admission(max_inflight=1)
    seen = []

    async def app(scope, receive, send):
        seen.append((scope["path"], scope.get("state", {}).get(TICKET), admission.inflight))

    state = SimpleNamespace(settings=Settings(gateway={"auth_disabled": True}), admission=admission, metrics=None)
    layer = EarlyAdmission(app)

    async def call(path: str, method: str = "POST") -> list[dict]:
        sent = []

        async def receive():
            raise AssertionError("the body was read")

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": method, "path": path, "headers": [], "app": SimpleNamespace(
            state=SimpleNamespace(gateway=state))}
        await layer(scope, receive, send)
        return sent

    assert asyncio.run(call("/v1/chat/completions")) == []
    path, ticket, inflight = seen[-1]
    assert path == "/v1/chat/completions" and ticket.tier == "normal" and inflight == 1  # held while answering
    assert ticket.released and admission.inflight == 0  # given back after
    admission.inflight = 1  # full
    start, body = asyncio.run(call("/v1/completions"))
    assert start["status"] == 503 and (b"retry-after", b"2") in start["headers"]
    assert json.loads(body["body"])["error"]["code"] == "overloaded" and len(seen) == 1
    assert asyncio.run(call("/v1/models", method="GET")) == [] and seen[-1][0] == "/v1/models"  # not generation
    assert seen[-1][1] is None
    admission.inflight = 0
    admission.drain()
    assert asyncio.run(call("/v1/chat/completions"))[0]["status"] == 503


def test_a_signal_before_the_gateway_loaded_its_app_stops_it_without_an_error():
    """SIGINT during start-up (Ctrl-C on `mirror-sd up` while it starts): uvicorn has no app yet."""
    import signal

    import uvicorn

    from gateway.drain import DrainingServer

    server = DrainingServer(uvicorn.Config("gateway.app:app"), drain_timeout_s=1.0)
    server.handle_exit(signal.SIGINT, None)
    assert server.should_exit and server.drain_started is None
