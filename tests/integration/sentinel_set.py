"""A Redis primary, one replica and three sentinels from the redis-server binary, for failover tests.

Nothing on disk (the drill is about what replication kept, not what a file kept); sentinels notice a dead
primary after DOWN_AFTER_MS and promote the replica. With `replica_lag_ms` the replica reads the primary
through the project's link (services/link), so it is always that far behind: kill_primary() then kills the
link too and the replica never gets the last writes, as when a primary's host dies with its replication
stream in flight.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from services.redis_conn import primary_address
from services.stack import find_redis_server, free_port

MASTER = "mirror"
DOWN_AFTER_MS = 1000
# Long: sentinels point a replica that follows another address (our link) back at the primary after this.
FAILOVER_TIMEOUT_MS = 600_000
NEXT_FAILOVER_TIMEOUT_MS = 2000


@dataclass
class SentinelSet:
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mirror-sd-sentinel-")))
    data_ports: list[int] = field(default_factory=lambda: [free_port(), free_port()])
    sentinel_ports: list[int] = field(default_factory=lambda: [free_port() for _ in range(3)])
    replica_lag_ms: float = 0.0
    processes: dict[int, subprocess.Popen] = field(default_factory=dict)
    link: subprocess.Popen | None = None

    def url(self, db: int = 0) -> str:
        hosts = ",".join(f"127.0.0.1:{port}" for port in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{MASTER}/{db}"

    def _spawn(self, port: int, args: list[str]) -> None:
        self.processes[port] = subprocess.Popen([find_redis_server(), *args, "--logfile", f"{port}.log"],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                                cwd=self.workdir, start_new_session=True)

    def _data_args(self, port: int) -> list[str]:
        return ["--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir)]

    def start(self, timeout_s: float = 30.0) -> "SentinelSet":
        primary, replica = self.data_ports
        self._spawn(primary, self._data_args(primary))
        upstream = primary
        if self.replica_lag_ms:
            upstream = free_port()
            self.link = subprocess.Popen(
                [sys.executable, "-m", "services.cli", "link", str(2 * self.replica_lag_ms), "--no-control",
                 "--to", f"redis://127.0.0.1:{primary}/0", "--port", str(upstream)],
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        self._spawn(replica, [*self._data_args(replica), "--replicaof", "127.0.0.1", str(upstream)])
        for port in self.sentinel_ports:
            config = self.workdir / f"sentinel-{port}.conf"  # sentinels rewrite their file: one each
            config.write_text(f"port {port}\nbind 127.0.0.1\ndir {self.workdir}\n"
                              f"sentinel monitor {MASTER} 127.0.0.1 {primary} 2\n"
                              f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                              f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
                              f"sentinel parallel-syncs {MASTER} 1\n")
            self._spawn(port, [str(config), "--sentinel"])
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if time.monotonic() > deadline:
                raise RuntimeError("the sentinel set did not come up (primary, replica in sync, 3 sentinels)")
            time.sleep(0.1)
        return self

    def _ready(self) -> bool:
        try:
            info = redis.Redis(port=self.data_ports[1]).info("replication")
            if info.get("master_link_status") != "up":
                return False
            sentinels = [redis.Redis(port=port) for port in self.sentinel_ports]
            # each knows the other two and the replica (found in the primary's INFO, read every 10 s)
            return all(len(one.sentinel_sentinels(MASTER)) >= 2 and one.sentinel_slaves(MASTER) for one in sentinels)
        except (redis.RedisError, OSError):
            return False

    def primary_port(self) -> int:
        return int(primary_address(self.url()).rpartition(":")[2])

    def kill_primary(self) -> int:
        """kill -9 of whichever server is primary now; its port."""
        port = self.primary_port()
        os.kill(self.processes[port].pid, signal.SIGKILL)
        if self.link is not None:
            self.link.kill()
        self.processes[port].wait()
        return port

    def wait_promoted(self, old_port: int, timeout_s: float = 30.0) -> int:
        """The new primary's port, once the sentinels name one other than `old_port`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                port = self.primary_port()
                if port != old_port:
                    return port
            except (redis.RedisError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no failover within {timeout_s:.0f}s")

    def restart(self, port: int, timeout_s: float = 60.0) -> None:
        """A killed server started again on its port: the sentinels make it a replica of the primary now. Then
        a next failover may come soon (sentinels otherwise wait twice FAILOVER_TIMEOUT_MS after the last)."""
        self._spawn(port, self._data_args(port))
        sentinels = [redis.Redis(port=sentinel) for sentinel in self.sentinel_ports]
        for sentinel in sentinels:
            sentinel.execute_command("SENTINEL", "SET", MASTER, "failover-timeout", str(NEXT_FAILOVER_TIMEOUT_MS))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                synced = redis.Redis(port=port).info("replication").get("master_link_status") == "up"
                if synced and all(self._good_replica(sentinel, port) for sentinel in sentinels):
                    return
            except (redis.RedisError, OSError):
                pass
            time.sleep(0.2)
        raise RuntimeError(f"the server on port {port} did not come back as a replica the sentinels can promote")

    @staticmethod
    def _good_replica(sentinel: redis.Redis, port: int) -> bool:
        for replica in sentinel.sentinel_slaves(MASTER):
            if int(replica["port"]) == port:
                return not ({"s_down", "o_down", "disconnected"} & set(str(replica["flags"]).split(",")))
        return False

    def stop(self) -> None:
        for process in [*self.processes.values(), *([self.link] if self.link else [])]:
            if process.poll() is None:
                process.kill()
                process.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
