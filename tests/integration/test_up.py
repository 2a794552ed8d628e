"""`mirror-sd up` (the README's main command): private Redis when none answers, serves, Ctrl-C stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from services.stack import free_port

pytestmark = pytest.mark.slow


def test_up_serves_the_readme_request_and_stops_cleanly(tmp_path):
    port = free_port()
    env = {
        **os.environ,
        "MIRROR_SD_REDIS_URL": "redis://127.0.0.1:1/0",  # nothing there: a private Redis must start
        "MIRROR_SD_DATABASE_URL": f"sqlite:///{tmp_path / 'up.db'}",
    }
    log = open(tmp_path / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "services.cli", "up", "--port", str(port)], env=env,
                          stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 240
        ready = False
        while time.monotonic() < deadline and up.poll() is None:
            try:
                ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
            except httpx.HTTPError:
                pass
            if ready:
                break
            time.sleep(1)
        assert ready, (tmp_path / "up.log").read_text()[-3000:]
        children = psutil.Process(up.pid).children(recursive=True)
        assert any("redis-server" in " ".join(child.cmdline()) for child in children)
        response = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "smollm2-135m", "messages": [{"role": "user", "content": "What is the capital of France?"}],
                  "max_tokens": 32, "temperature": 0},
            timeout=120,
        )
        assert response.status_code == 200, response.text
        assert "Paris" in response.json()["choices"][0]["message"]["content"]
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [child.cmdline() for child in alive]
    finally:
        if up.poll() is None:
            up.kill()
        log.close()
