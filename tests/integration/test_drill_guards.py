"""The drills refuse what would hurt more than the stack they test."""

from __future__ import annotations

import os
import subprocess
import sys

import redis

from services.cli.drill import check_redis_comes_back
from services.protocol import CHILDREN_KEY, ChildStatus


def _drill(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MIRROR_SD_REDIS_URL": redis_url}
    return subprocess.run([sys.executable, "-m", "services.cli", "drill", "chaos", "--url", "http://127.0.0.1:9",
                           *args], env=env, capture_output=True, text=True, timeout=120, check=False)


def test_restarting_a_redis_that_up_does_not_run_is_refused_and_redis_keeps_running(redis_url):
    """`mirror-sd up` on an external Redis (MIRROR_SD_REDIS_URL) supervises its workers, not that Redis: a
    SHUTDOWN would stop it for good (and for everyone else on it)."""
    client = redis.Redis.from_url(redis_url)
    for name in ("gateway", "verify-worker", "draft-worker", "telemetry"):
        client.hset(CHILDREN_KEY, name, ChildStatus(name=name, state="running", pid=1).encode())
    refused = _drill(redis_url, "--restart-redis", "--kills", "0", "--requests", "1")
    assert refused.returncode != 0, refused.stdout
    assert "is not one `mirror-sd up` runs" in refused.stderr and "draft-worker, gateway" in refused.stderr
    assert client.ping() and "chaos: Redis SHUTDOWN" not in refused.stdout + refused.stderr

    client.hset(CHILDREN_KEY, "redis", ChildStatus(name="redis", state="running", pid=1).encode())
    check_redis_comes_back(client, redis_url)  # up's own Redis: its supervisor starts it again
    client.delete(CHILDREN_KEY)
    check_redis_comes_back(client, redis_url)  # no supervisor (compose): its restart policy is trusted
