"""`MIRROR_SD_LOG_FORMAT=json` (what compose sets): every service's output is JSON lines, and the lines about a
request carry its id, in the gateway, the draft worker and the verify worker (real processes, a tiny target)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.conftest import WORDS, save_tiny_model
from tests.integration.stack import Stack

SERVICES = {"gateway": "gateway", "draft-worker": "draft-worker", "verify-json-0": "verify-worker",
            "telemetry": "telemetry"}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("json-logs")
    target = save_tiny_model(root / "target", seed=0, words=WORDS)
    running = Stack(root, pool="json", verify_workers=1, auth=False, telemetry=True,
                    env={"MIRROR_SD_LOG_FORMAT": "json", "MIRROR_SD_TARGET": str(target), "MIRROR_SD_DRAFT": "ngram",
                         "MIRROR_SD_TELEMETRY__FALLBACK_POOL": "json"})
    try:
        yield running.start()
    finally:
        running.stop()


def log_lines(stack: Stack, name: str) -> list[dict]:
    text = (stack.workdir / f"{name}.log").read_text()
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                pytest.fail(f"{name}.log line {number} is not JSON: {line[:300]!r}")
    return lines


def test_every_line_is_json_and_lines_about_a_request_carry_its_id(stack):
    model = httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"]
    prompt = " ".join(WORDS[2:10] * 3)  # repeats: prompt lookup drafts, so blocks go both ways
    response = httpx.post(f"{stack.base_url}/v1/completions", timeout=120,
                          json={"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert response.status_code == 200, response.text
    request_id = response.json()["id"]
    assert httpx.get(f"{stack.base_url}/v1/requests/{request_id}").status_code == 200
    time.sleep(1.5)  # the draft worker's task-succeeded line and a few telemetry ticks

    for name, service in SERVICES.items():
        lines = log_lines(stack, name)  # read while the process runs: nothing here is a shutdown message
        assert lines, name
        for line in lines:
            assert {"ts", "level", "logger", "message", "worker_id", "request_id"} <= set(line), (name, line)
            assert line["service"] == service, (name, line)
            if request_id in line["message"]:
                assert line["request_id"] == request_id, (name, line)
        if service != "telemetry":
            about = [line for line in lines if line["request_id"] == request_id]
            assert about, f"{name}: no line carries {request_id}"
    gateway = [line["message"] for line in log_lines(stack, "gateway") if line["request_id"] == request_id]
    assert any("POST /v1/completions" in message for message in gateway), gateway  # uvicorn's access line
    assert any(f"GET /v1/requests/{request_id}" in message for message in gateway), gateway
    assert log_lines(stack, "verify-json-0")[0]["worker_id"] == "verify-json-0"
