"""`mirror-sd up`'s supervisor: child processes restarted when they die, stopped in order.

A child that exits is started again after a backoff (0.5 s, doubling to 10 s;
back to 0.5 s once it has stayed up 30 s), with a log line and a count in
Redis (`RESTARTS_KEY`) that the gateway exports as
`mirror_sd:child_restarts{child=...}`. The stack never stops for one child.
A child that keeps exiting on its own soon after it starts (it never stays
up 30 s) is a configuration problem, not a crash: after `max_quick_failures`
the supervisor gives up and says which child and where its log is. A child
killed by a signal after its first seconds (kill -9, the OOM killer) is
always started again at once.

Children run in their own sessions, so a terminal's Ctrl-C reaches only the
supervisor, which then stops them in order: gateway first (it drains its
streams), then draft workers (Celery's warm shutdown), verify workers,
telemetry; a child that outlives its grace period is killed.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

STOP_ORDER = ("gateway", "draft-worker", "verify", "telemetry", "redis")  # name prefixes, stopped in this order


def restart_delay(consecutive_failures: int, base_s: float = 0.5, cap_s: float = 10.0) -> float:
    """Backoff before restart number `consecutive_failures` (1, 2, ...) of a child that keeps dying."""
    return min(cap_s, base_s * 2 ** max(0, consecutive_failures - 1))


def stop_rank(name: str) -> int:
    return next((rank for rank, prefix in enumerate(STOP_ORDER) if name.startswith(prefix)), len(STOP_ORDER))


class GaveUp(RuntimeError):
    """A child failed at start-up again and again: restarting it will not help."""


@dataclass
class Child:
    name: str
    command: list[str]
    env: dict[str, str]
    affinity: set[int] | None = None
    log_path: Path | None = None
    grace_s: float = 15.0  # SIGTERM to SIGKILL when stopping
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    failures: int = 0  # consecutive quick deaths
    restarts: int = 0
    restart_at: float | None = None  # when a dead child is due to start again

    def start(self) -> None:
        output = open(self.log_path, "a") if self.log_path else None  # noqa: SIM115 - the child owns it
        affinity = self.affinity
        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=output, stderr=subprocess.STDOUT if output else None,
            start_new_session=True,  # Ctrl-C goes to the supervisor, which stops children in order
            preexec_fn=(lambda: os.sched_setaffinity(0, affinity)) if affinity else None)
        if output is not None:
            output.close()  # the child has its own descriptor
        self.started_at = time.monotonic()
        self.restart_at = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Supervisor:
    children: dict[str, Child]
    on_restart: Callable[[str, int], None] | None = None  # (name, restarts so far), e.g. count it in Redis
    stable_s: float = 30.0
    min_up_s: float = 5.0  # a signal death after this long resets the backoff
    max_quick_failures: int = 5
    base_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    _stopping: bool = field(default=False, init=False)

    def start(self, skip: tuple[str, ...] = ()) -> None:
        for child in self.children.values():
            if child.name not in skip:
                child.start()

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        return {name: child.process for name, child in self.children.items() if child.process is not None}

    def check(self, now: float | None = None) -> list[str]:
        """One look at every child: schedule a restart for the dead, start those due. Returns the names
        started again. Raises GaveUp when a child has died young max_quick_failures times in a row."""
        now = time.monotonic() if now is None else now
        restarted = []
        for child in self.children.values():
            if self._stopping:
                break
            if child.restart_at is None and not child.alive:
                code = child.process.returncode if child.process is not None else None
                lived = now - child.started_at
                # a child killed by a signal after it got going (kill -9, the OOM killer) is not a
                # configuration error: restart it at once, however often it happens
                killed = code is not None and code < 0 and lived >= self.min_up_s
                child.failures = 1 if lived >= self.stable_s or killed else child.failures + 1
                if child.failures > self.max_quick_failures:
                    raise GaveUp(f"{child.name} exited {child.failures} times in a row within {self.stable_s:.0f}s "
                                 f"of starting (last exit code {code})"
                                 + (f"; see {child.log_path}" if child.log_path else ""))
                delay = restart_delay(child.failures, self.base_backoff_s, self.max_backoff_s)
                child.restart_at = now + delay
                logger.warning("%s exited with code %s after %.1fs; restarting in %.1fs", child.name, code, lived,
                               delay)
            if child.restart_at is not None and now >= child.restart_at:
                child.start()
                child.restarts += 1
                restarted.append(child.name)
                logger.warning("%s restarted (restart %d, pid %d)", child.name, child.restarts, child.process.pid)
                if self.on_restart is not None:
                    try:
                        self.on_restart(child.name, child.restarts)
                    except Exception as exc:  # the count is for /metrics; Redis may be the one that is down
                        logger.warning("could not record the restart of %s: %s", child.name, exc)
        return restarted

    def stop(self, grace_s: float | None = None) -> None:
        """SIGTERM in STOP_ORDER, each group waited for before the next; SIGKILL after the grace period."""
        self._stopping = True
        ranks = sorted({stop_rank(name) for name in self.children})
        for rank in ranks:
            group = [c for c in self.children.values() if stop_rank(c.name) == rank and c.alive]
            for child in group:
                child.process.send_signal(signal.SIGTERM)
            for child in group:
                try:
                    child.process.wait(timeout=grace_s if grace_s is not None else child.grace_s)
                except subprocess.TimeoutExpired:
                    logger.warning("%s did not stop within its grace period; killing it", child.name)
                    child.process.kill()
                    child.process.wait(timeout=10)

    def kill_all(self) -> None:
        """A second Ctrl-C: no more waiting."""
        self._stopping = True
        for child in self.children.values():
            if child.alive:
                child.process.kill()
