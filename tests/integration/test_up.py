"""`mirror-sd up` (the README's main command): private Redis when none answers, serves, Ctrl-C stops all."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from services.stack import choose_placement, free_port
from tests.integration.conftest import up_verify_threads
from tests.integration.stack import assert_up_stops_cleanly

pytestmark = pytest.mark.slow


def test_up_serves_the_readme_request_and_stops_cleanly(tmp_path, warm_up_profile):
    port = free_port()
    env = {
        **os.environ,
        "MIRROR_SD_REDIS_URL": "redis://127.0.0.1:1/0",  # nothing there: a private Redis must start
        "MIRROR_SD_DATABASE_URL": f"sqlite:///{tmp_path / 'up.db'}",
    }
    warm_up_profile(up_verify_threads(model_draft=True, local=choose_placement("auto", "cpu") == "local"))
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

        # the chaos drill: kill -9 of random workers and a Redis restart under load; the supervisor brings
        # each back (the private Redis keeps its data in an append-only file) and no request is lost
        private_url = re.search(r"export MIRROR_SD_REDIS_URL=(\S+)", (tmp_path / "up.log").read_text()).group(1)
        drill = subprocess.run(
            [sys.executable, "-m", "services.cli", "drill", "chaos", "--url", f"http://127.0.0.1:{port}", "--kills",
             "2", "--requests", "4", "--concurrency", "2", "--max-tokens", "24", "--restart-redis",
             "--out", str(tmp_path / "chaos.json")],
            env={**env, "MIRROR_SD_REDIS_URL": private_url}, capture_output=True, text=True, timeout=400)
        assert drill.returncode == 0, drill.stdout + drill.stderr + (tmp_path / "up.log").read_text()[-3000:]
        report = json.loads((tmp_path / "chaos.json").read_text())
        assert report["lost"] == report["doubled"] == report["mismatched"] == 0
        assert report["identical"] == report["requests"] >= 4
        assert len(report["kills"]) == 2 and all(kill["back_after_s"] is not None for kill in report["kills"])
        assert report["redis_restart_s"] is not None and up.poll() is None
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        restarts = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                    if line.startswith("mirror_sd:child_restarts{")}
        killed = {"draft-worker" if kill["role"] == "draft" else "verify-worker" for kill in report["kills"]}
        assert all(restarts.get(name, 0) >= 1 for name in killed | {"redis"}), restarts

        assert_up_stops_cleanly(up)
    finally:
        if up.poll() is None:
            up.kill()
        log.close()
