"""A real stack for tests: Redis, a gateway, draft and verify workers as processes, real HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

from services.protocol import HEARTBEAT_PATTERN, Heartbeat
from services.gateway_client import sse_payload
from services.redis_conn import connect
from services.stack import child_commands, free_port, stop_children
from services.storage import crud
from services.storage.db import init_db, session_factory
from tests.redis_dbs import DATABASES

class Stack:
    def __init__(self, workdir: Path, *, pool: str = "cpu", verify_workers: int = 2,
                 draft_concurrency: int = 8, auth: bool = True, verify_pools: list[str] | None = None,
                 telemetry: bool = False, env: dict[str, str] | None = None, redis_url: str | None = None,
                 gateway_args: tuple[str, ...] = ()) -> None:
        self.workdir = workdir
        self.pool = pool
        self.port = free_port()
        self.telemetry_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.leased = None if redis_url else DATABASES.take()  # a database of its own (tests/redis_dbs.py)
        self.redis_url = redis_url or self.leased
        self.database_url = f"sqlite:///{workdir / 'mirror-sd.db'}"
        self.env = {
            **os.environ,
            "MIRROR_SD_REDIS_URL": self.redis_url,
            "MIRROR_SD_DATABASE_URL": self.database_url,
            "MIRROR_SD_WORKER__POOL": pool,
            "MIRROR_SD_WORKER__DRAFT_CONCURRENCY": str(draft_concurrency),
            "MIRROR_SD_WORKER__VERDICT_TIMEOUT_S": "60",
            "MIRROR_SD_GATEWAY__AUTH_DISABLED": "false" if auth else "true",
            "MIRROR_SD_NUM_THREADS": "1",
            "MIRROR_SD_TELEMETRY__METRICS_PORT": str(self.telemetry_port),
            **(env or {}),
        }
        pools = verify_pools or [pool] * verify_workers
        self.verify_ids = [f"verify-{verify_pool}-{index}" for index, verify_pool in enumerate(pools)]
        self.verify_pool_of = dict(zip(self.verify_ids, pools))
        self.telemetry = telemetry
        self.gateway_args = list(gateway_args)  # e.g. --workers 2
        self.processes: dict[str, subprocess.Popen] = {}
        self.redis = connect(self.redis_url)
        self.db = None

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.workdir / f"{name}.log", "a")  # noqa: SIM115 - lives as long as the child
        self.processes[name] = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT)

    def respawn(self, name: str) -> None:
        """Start a dead child again with its own command (what `mirror-sd up`'s supervisor does)."""
        assert self.processes[name].poll() is not None, f"{name} is still running"
        self._spawn(name, list(self.processes[name].args))

    def spawn_verify(self, worker_id: str) -> None:
        command = child_commands(port=self.port, verify_threads=1, draft_threads=1)["verify-worker"]
        self._spawn(worker_id, [*command, "--worker-id", worker_id, "--pool", self.verify_pool_of[worker_id]])

    def start(self, timeout_s: float = 180) -> "Stack":
        self.redis.flushdb()
        self.db = session_factory(init_db(self.database_url))
        commands = child_commands(port=self.port, verify_threads=1, draft_threads=1)
        for worker_id in self.verify_ids:
            self.spawn_verify(worker_id)
        self._spawn("draft-worker", [*commands["draft-worker"], "--worker-id", f"draft-{self.pool}"])
        self._spawn("gateway", [*commands["gateway"], *self.gateway_args])
        if self.telemetry:
            self._spawn("telemetry", commands["telemetry"])
        self.wait_ready(timeout_s)
        return self

    def wait_ready(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(f"{name} died: {(self.workdir / f'{name}.log').read_text()[-3000:]}")
            try:
                ready = httpx.get(f"{self.base_url}/readyz", timeout=2).json()
                if ready["ready"] and ready["verify_workers"] >= len(self.live_verify_ids()):
                    draft = self.processes.get("draft-worker")  # a live one heartbeats once its draft is loaded
                    drafting = draft is not None and draft.poll() is None
                    if len(self.heartbeats("verify")) == len(self.live_verify_ids()) and (
                            not drafting or self.heartbeats("draft")):
                        return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)
        raise RuntimeError("stack not ready in time")

    def live_verify_ids(self) -> list[str]:
        return [wid for wid in self.verify_ids if self.processes[wid].poll() is None]

    def heartbeats(self, role: str | None = None) -> list[Heartbeat]:
        beats = []
        for key in self.redis.scan_iter(match=HEARTBEAT_PATTERN):
            raw = self.redis.get(key)
            if raw is not None:
                beat = Heartbeat.decode(raw)
                if role is None or beat.role == role:
                    beats.append(beat)
        return beats

    def kill(self, name: str) -> None:
        self.processes[name].send_signal(signal.SIGKILL)
        self.processes[name].wait(timeout=10)

    def create_key(self, priority: str = "normal") -> str:
        with self.db() as session:
            return crud.create_api_key(session=session, name=f"test-{priority}", priority=priority)[1]

    def stop(self) -> None:
        stop_children(self.processes)
        self.redis.flushdb()
        if self.leased:
            DATABASES.give_back(self.leased)


def sse_events(response: httpx.Response) -> Iterator[dict | str]:
    """A streamed completion's events: each `data:` line's JSON, and "[DONE]" last (services/gateway_client.py)."""
    for line in response.iter_lines():
        payload = sse_payload(line)
        if payload is not None:
            yield payload


def delta_text(event: dict | str) -> str:
    """The content a chunk adds ("" for other events)."""
    if isinstance(event, dict) and event.get("choices"):
        return event["choices"][0]["delta"].get("content") or ""
    return ""


def assert_up_stops_cleanly(up: subprocess.Popen) -> None:
    """SIGINT to a `mirror-sd up`: it exits 0 and leaves none of its children behind."""
    children = psutil.Process(up.pid).children(recursive=True)
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=90) == 0
    _gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, [child.cmdline() for child in alive]
