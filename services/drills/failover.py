"""The failover part of the chaos drill: kill -9 of the Redis primary on this host, and the time until the
stack serves a request again (services/drills/chaos.py runs them mid-run with `--failover`)."""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

import httpx
import redis


def kill_redis_primary(client: redis.Redis) -> tuple[int, str]:
    """kill -9 of the Redis server `client` talks to (the primary, for a Sentinel client), when it runs on
    this host: its pid and address. The pid it reports is checked against this host's process table (a
    Redis in a container or on another host reports a pid that is not its pid here)."""
    info = client.info("server")
    pid, port = int(info["process_id"]), int(info["tcp_port"])
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
    except OSError:
        command = b""
    if b"redis-server" not in command or f":{port}".encode() not in command:
        raise RuntimeError(f"the Redis primary (port {port}, pid {pid} in its own view) is not a process of this "
                           "host: run the failover drill on the primary's host")
    os.kill(pid, signal.SIGKILL)
    return pid, f"{info.get('executable', 'redis-server')} :{port}"


def first_served(url: str, model: str, timeout_s: float) -> float | None:
    """Seconds until a short greedy request is answered 200 (None: not within timeout_s)."""
    started = time.monotonic()
    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
            "temperature": 0, "cache_salt": uuid.uuid4().hex}
    with httpx.Client(base_url=url, timeout=10) as client:
        while time.monotonic() - started < timeout_s:
            try:
                if client.post("/v1/chat/completions", json=body).status_code == 200:
                    return time.monotonic() - started
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    return None
