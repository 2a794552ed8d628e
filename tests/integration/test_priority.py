"""Higher API-key tiers are served first when sessions queue up (one draft slot, real Celery priorities)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from services.gateway_client import DONE
from tests.integration.stack import Stack, sse_events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = Stack(tmp_path_factory.mktemp("prio"), pool="prio", verify_workers=1,
                    draft_concurrency=1).start()
    yield running
    running.stop()


def start_stream(base_url: str, key: str, prompt: str, max_tokens: int) -> tuple[str, threading.Thread]:
    """Open a streaming request, return its id (from the first chunk) and the thread draining it."""
    first = threading.Event()
    found: dict[str, str] = {}

    def run() -> None:
        body = {"model": "smollm2-135m", "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {key}"}) as response:
            for chunk in sse_events(response):
                if chunk != DONE and not first.is_set():
                    found["id"] = chunk["id"]
                    first.set()

    thread = threading.Thread(target=run)
    thread.start()
    assert first.wait(30), "no first chunk"
    return found["id"], thread


def test_high_priority_overtakes_queued_low_priority(stack):
    low, high = stack.create_key("low"), stack.create_key("high")
    status = lambda key, rid: httpx.get(f"{stack.base_url}/v1/requests/{rid}",  # noqa: E731
                                        headers={"Authorization": f"Bearer {key}"}).json()
    # the blocker holds the one draft slot until it is cancelled below, once all four wait: a fixed length
    # would let a fast box finish it, and start a low one, before the urgent one is even sent
    blocker, blocker_thread = start_stream(stack.base_url, low, "Tell me a story.", 400)
    deadline = time.monotonic() + 30
    while status(low, blocker)["status"] != "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    queued = [start_stream(stack.base_url, low, f"Count to {n}.", 4) for n in (3, 4, 5)]
    time.sleep(0.3)
    urgent, urgent_thread = start_stream(stack.base_url, high, "Say yes.", 4)
    time.sleep(0.3)
    cancelled = httpx.delete(f"{stack.base_url}/v1/requests/{blocker}", headers={"Authorization": f"Bearer {low}"})
    assert cancelled.status_code == 200 and cancelled.json()["cancelled"] is True, cancelled.text
    for _, thread in [*queued, (urgent, urgent_thread), (blocker, blocker_thread)]:
        thread.join(timeout=240)
    urgent_started = status(high, urgent)["started_at"]
    low_started = [status(low, rid)["started_at"] for rid, _ in queued]
    assert all(started is not None for started in [urgent_started, *low_started])
    assert urgent_started < min(low_started), (urgent_started, low_started)
    # Low requests keep their own order among themselves.
    assert low_started == sorted(low_started)
