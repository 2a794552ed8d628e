"""Redis Sentinel failover under load: a real stack on a primary, a replica and three sentinels; kill -9 of
the primary while streams run. Every stream ends identical to target-only or with an OpenAI-shaped error,
none hangs, no token is doubled, and new requests are served again soon after the kill."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import httpx
import pytest

from services.engine import GenerationOptions, generate
from services.models.drafters import DraftSource
from services.models.tokenization import encode_prompt
from tests.integration.sentinel_set import SentinelSet
from tests.integration.stack import Stack, delta_text, sse_events

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
STREAMS = 8
MAX_TOKENS = 48
REPLICA_LAG_MS = 300  # what the replica misses when the primary dies: every write of the last 300 ms
KILL_AFTER_CHUNKS = 3  # every stream has this many content chunks before the kill


@pytest.fixture(scope="module")
def sentinels():
    started = SentinelSet(replica_lag_ms=REPLICA_LAG_MS).start()
    yield started
    started.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, sentinels):
    running = Stack(tmp_path_factory.mktemp("failover"), verify_workers=1, auth=False,
                    redis_url=sentinels.url(0), env={"MIRROR_SD_DRAFT": "ngram"}).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def prompts(dev_prompts) -> list[str]:
    return [prompt["prompt"] for prompt in dev_prompts[:STREAMS]]


@pytest.fixture(scope="module")
def expected(builtin_target, prompts) -> list[list[int]]:
    return [generate(builtin_target, DraftSource("none"), encode_prompt(builtin_target.tokenizer, prompt, chat=True),
                     GenerationOptions(max_new_tokens=MAX_TOKENS)).token_ids for prompt in prompts]


def body(prompt: str, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "return_token_ids": True, "stream": True, **extra}


class StreamRun(threading.Thread):
    """One streamed request: its events (dicts, then "[DONE]"), its text, its content chunks so far."""

    def __init__(self, url: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url, self.prompt = url, prompt
        self.events: list = []
        self.text = ""
        self.chunks = 0
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=180) as client:
                with client.stream("POST", "/v1/chat/completions", json=body(self.prompt)) as response:
                    assert response.status_code == 200, response.read()
                    for event in sse_events(response):
                        self.events.append(event)
                        self.text += delta_text(event)
                        self.chunks += bool(isinstance(event, dict) and event.get("choices"))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.failure = exc


def served_after(url: str, prompt: str, timeout_s: float) -> float:
    started = time.monotonic()
    with httpx.Client(base_url=url, timeout=30) as client:
        while time.monotonic() - started < timeout_s:
            try:
                answer = client.post("/v1/chat/completions", json={**body(prompt, stream=False), "max_tokens": 4})
                if answer.status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    return float("inf")


def test_primary_killed_under_load_loses_and_doubles_nothing(stack, sentinels, prompts, expected, builtin_target):
    runs = [StreamRun(stack.base_url, prompt) for prompt in prompts]
    for run in runs:
        run.start()
    deadline = time.monotonic() + 120
    while not all(run.chunks >= KILL_AFTER_CHUNKS or not run.is_alive() for run in runs):
        assert time.monotonic() < deadline, "streams did not start"
        time.sleep(0.02)
    old = sentinels.kill_primary()
    served_s = served_after(stack.base_url, "Say hello.", 30)
    for run in runs:
        run.join(timeout=240)
        assert not run.is_alive(), "a stream hangs after the failover"
        assert run.failure is None, repr(run.failure)
    assert sentinels.primary_port() != old
    identical = 0
    for run, tokens in zip(runs, expected):
        assert run.events[-1] == "[DONE]", run.events[-3:]
        errors = [event for event in run.events[:-1] if "error" in event]
        text = builtin_target.tokenizer.decode(tokens, skip_special_tokens=True)
        if errors:  # a clean end: OpenAI-shaped, and what came before it is a prefix of the right answer
            assert errors[0]["error"]["message"] and errors[0]["error"]["code"], errors[0]
            assert text.startswith(run.text)
            continue
        final = [event for event in run.events[:-1] if event.get("choices")][-1]["choices"][0]["token_ids"]
        assert final == tokens
        assert run.text == text  # nothing doubled or skipped on the way
        identical += 1
    assert identical >= STREAMS - 1, f"{identical} of {STREAMS} identical"
    assert served_s != float("inf"), "no request served within 30 s of the kill"  # liveness; the drill times it
    # the drill did lose writes (the replica was REPLICA_LAG_MS behind), and the verify worker made them good
    assert "committed them again" in (stack.workdir / "verify-cpu-0.log").read_text()
    status = json.loads(cli(stack, "status", "--json").stdout)
    assert status["redis"].startswith(f"primary 127.0.0.1:{sentinels.primary_port()} (sentinel master")
    sentinels.restart(old)  # a replica again, for the next failover


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "services.cli", *args], env=stack.env, capture_output=True,
                          text=True, timeout=300, check=False)


def test_the_failover_drill_kills_the_primary_of_a_running_fleet_and_reports(stack, sentinels, tmp_path):
    before = sentinels.primary_port()
    drill = cli(stack, "drill", "chaos", "--url", stack.base_url, "--failover", "--kills", "0", "--requests", "4",
                "--concurrency", "4", "--max-tokens", "24", "--every", "1", "--out", str(tmp_path / "drill.json"))
    assert drill.returncode == 0, drill.stdout + drill.stderr
    report = json.loads((tmp_path / "drill.json").read_text())
    assert report["failover"]["old_primary"].endswith(f":{before}") and sentinels.primary_port() != before
    assert report["failover"]["promoted_s"] is not None and report["failover"]["served_s"] is not None
    assert report["lost"] == report["doubled"] == report["mismatched"] == 0
    assert "failover: primary" in drill.stdout


def test_the_failover_drill_needs_a_sentinel_url():
    env = {**os.environ, "MIRROR_SD_REDIS_URL": "redis://:secret@127.0.0.1:1/0"}
    plain = subprocess.run([sys.executable, "-m", "services.cli", "drill", "chaos", "--failover"], env=env,
                           capture_output=True, text=True, timeout=120, check=False)
    assert plain.returncode != 0 and "--failover needs a redis+sentinel:// redis_url" in plain.stderr
    assert "secret" not in plain.stderr
