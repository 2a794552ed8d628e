"""Faults an operator causes, on a real stack with one verify worker and its own Redis (append-only file on):
kill -9 of the draft worker or of the only verify worker mid-stream, Redis restarted (with and without its
data), SIGTERM to the gateway mid-stream. No request is lost, no token doubled or skipped, no process exits."""

from __future__ import annotations

import shutil
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest
import redis

from services.engine import GenerationOptions, generate
from services.models.drafters import DraftSource
from services.models.tokenization import encode_prompt
from services.stack import PrivateRedis
from tests.integration.stack import Stack, delta_text, sse_events

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
PROMPT = "List ten animals that live in the ocean, one per line, with one fact about each."
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def private_redis():
    server = PrivateRedis().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, private_redis):
    running = Stack(tmp_path_factory.mktemp("reliability"), verify_workers=1, auth=False,
                    redis_url=private_redis.url,
                    env={"MIRROR_SD_DRAFT": "ngram", "MIRROR_SD_GATEWAY__DRAIN_TIMEOUT_S": "60"}).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def expected(builtin_target) -> list[int]:
    prompt_ids = encode_prompt(builtin_target.tokenizer, PROMPT, chat=True)
    return generate(builtin_target, DraftSource("none"), prompt_ids,
                    GenerationOptions(max_new_tokens=MAX_TOKENS)).token_ids


def body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True, "stream": True, **extra}


def stream_with_fault(url: str, fault, after_chunks: int = 3, timeout_s: float = 240) -> tuple[list, str]:
    """Stream the prompt; call fault() once `after_chunks` content chunks arrived. Returns (events, text)."""
    events, text, faulted = [], "", False
    with httpx.Client(base_url=url, timeout=timeout_s) as client:
        with client.stream("POST", "/v1/chat/completions", json=body()) as response:
            assert response.status_code == 200, response.read()
            for event in sse_events(response):
                events.append(event)
                text += delta_text(event)
                if not faulted and sum(isinstance(e, dict) and bool(e.get("choices")) for e in events) > after_chunks:
                    faulted = True
                    fault()
    assert faulted, "the stream ended before the fault"
    return events, text


def final_tokens(events: list) -> list[int]:
    assert events[-1] == "[DONE]", events[-3:]
    return [e for e in events[:-1] if e.get("choices")][-1]["choices"][0]["token_ids"]


def all_alive(stack: Stack) -> bool:
    return all(process.poll() is None for process in stack.processes.values())


def test_a_killed_draft_worker_is_replaced_and_the_stream_resumes_identically(stack, expected, builtin_target):
    def kill_and_restart():
        stack.kill("draft-worker")
        stack.respawn("draft-worker")

    events, text = stream_with_fault(stack.base_url, kill_and_restart)
    assert final_tokens(events) == expected
    # no token repeated or skipped on the way: the deltas add up to the text of the expected tokens
    assert text == builtin_target.tokenizer.decode(expected, skip_special_tokens=True)
    # and the replacement serves: the verify worker may finish the stream on its own before the new draft
    # worker is up (5 s on one box), and the next request would be refused until it is
    stack.wait_ready()
    assert stack.heartbeats("draft")


def test_sigterm_to_the_draft_worker_lets_its_session_finish_then_it_exits_0(stack, expected):
    """Celery's warm shutdown: the draft worker takes no new session, drives the one it has to its end, exits 0."""
    draft = stack.processes["draft-worker"]
    events, _ = stream_with_fault(stack.base_url, lambda: draft.send_signal(signal.SIGTERM))
    assert final_tokens(events) == expected
    assert not any("error" in event for event in events[:-1])
    assert draft.wait(timeout=60) == 0
    stack.respawn("draft-worker")
    stack.wait_ready()


def test_a_killed_only_verify_worker_is_replaced_and_rebuilds_the_session(stack, expected):
    def kill_then_restart_later():
        stack.kill("verify-cpu-0")
        threading.Timer(4.0, stack.respawn, args=("verify-cpu-0",)).start()  # after its heartbeat has lapsed

    events, _ = stream_with_fault(stack.base_url, kill_then_restart_later)
    assert final_tokens(events) == expected
    stack.wait_ready()


def restart_redis(server: PrivateRedis, *, keep_data: bool, down_s: float = 1.0) -> None:
    client = redis.Redis.from_url(server.url)
    try:
        client.shutdown(nosave=not keep_data)
    except redis.ConnectionError:
        pass
    server.process.wait(timeout=10)
    if not keep_data:
        for path in Path(server.workdir).iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    time.sleep(down_s)
    server.start()


def served_within(url: str, timeout_s: float) -> float:
    """Seconds until a short request succeeds."""
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() - started < timeout_s:
            try:
                answer = client.post("/v1/chat/completions", json={**body(stream=False), "max_tokens": 4})
                if answer.status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"no request served within {timeout_s}s")


def test_redis_restarted_with_its_data_loses_no_request_and_no_process(stack, private_redis, expected):
    events, _ = stream_with_fault(stack.base_url, lambda: restart_redis(private_redis, keep_data=True))
    assert final_tokens(events) == expected
    assert all_alive(stack)
    assert served_within(stack.base_url, 60) < 60


def test_redis_that_lost_its_data_ends_the_request_with_an_error_event(stack, private_redis):
    events, _ = stream_with_fault(stack.base_url, lambda: restart_redis(private_redis, keep_data=False))
    assert events[-1] == "[DONE]"
    errors = [e for e in events[:-1] if "error" in e]
    assert errors and errors[0]["error"]["code"] == "request_lost", events[-3:]
    assert all_alive(stack)
    stack.wait_ready(60)  # heartbeats come back into the empty Redis
    assert served_within(stack.base_url, 60) < 60


def test_sigterm_drains_the_gateway_streams_finish_and_it_exits_0(stack, expected):
    gateway = stack.processes["gateway"]
    seen: dict[str, object] = {}

    def sigterm():
        gateway.send_signal(signal.SIGTERM)
        with httpx.Client(base_url=stack.base_url, timeout=10) as client:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and "readyz" not in seen:
                ready = client.get("/readyz")
                if ready.status_code == 503 and ready.json().get("draining"):
                    seen["readyz"] = ready.json()
            refused = client.post("/v1/chat/completions", json={**body(stream=False), "max_tokens": 4})
            seen["new"] = (refused.status_code, refused.headers.get("Retry-After"), refused.json())

    events, _ = stream_with_fault(stack.base_url, sigterm)
    assert final_tokens(events) == expected
    assert seen["readyz"]["draining"] is True
    status, retry_after, answer = seen["new"]
    assert status == 503 and retry_after and "shutting down" in answer["error"]["message"]
    assert gateway.wait(timeout=30) == 0
    stack.respawn("gateway")
    stack.wait_ready()
