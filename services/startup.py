"""How long `mirror-sd up` waits for its stack: a deadline that moves while the children work.

A big target takes minutes to start on a small box (loading or initialising its weights, measuring its
profiles) and a fixed wait gives up on it while it is busy (a random llama-1b on 2 cores: over 180 s).
So start-up fails only after `timeout_s` in which the children did no work (under half a core between
them: an idle gateway, telemetry and draft worker use a few percent), or after `cap_s` whatever they do.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable

import psutil

WORKING_CORES = 0.5  # the children's CPU over a poll, in cores, above which start-up is making progress


class StartupDeadline:
    """Pure: fed the children's cumulative CPU seconds at each poll, says when start-up has stalled."""

    def __init__(self, timeout_s: float, now: float, *, cap_s: float | None = None) -> None:
        self.timeout_s = timeout_s
        self.deadline = now + timeout_s
        self.cap = now + (cap_s if cap_s is not None else 10 * timeout_s)
        self._last: tuple[float, float] | None = None  # (now, cpu_s) at the previous poll

    def poll(self, now: float, cpu_s: float) -> None:
        if self._last is not None:
            then, before = self._last
            if now > then and (cpu_s - before) / (now - then) >= WORKING_CORES:
                self.deadline = min(now + self.timeout_s, self.cap)
        self._last = (now, cpu_s)

    def expired(self, now: float) -> bool:
        return now >= self.deadline


def cpu_seconds(processes: Iterable[subprocess.Popen]) -> float:
    """User and system CPU seconds of these processes and their descendants (gone ones count 0)."""
    total = 0.0
    for popen in processes:
        try:
            process = psutil.Process(popen.pid)
            for member in [process, *process.children(recursive=True)]:
                times = member.cpu_times()
                total += times.user + times.system
        except psutil.Error:
            continue
    return total
