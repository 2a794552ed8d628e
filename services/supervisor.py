"""`mirror-sd up`'s supervisor: child processes restarted when they die, bounded when they cannot start, stopped
in order, and never outliving it. (Just over 300 lines: restart, backoff, failure and stop rules of one
process tree.)

A child that exits is started again after a backoff (0.5 s, doubling to 10 s;
back to 0.5 s once it has stayed up 30 s), with a log line and its state
published (`on_change`: a ChildStatus per child in Redis, which /metrics,
/readyz, the dashboard and `mirror-sd status` show). What counts against it:

- killed from outside (SIGKILL, SIGTERM: kill -9, the OOM killer) after its
  first seconds: started again at once, however often; that is what the
  chaos drill does;
- died by its own fault (SIGSEGV, SIGILL, SIGBUS, SIGABRT, SIGFPE) or exited
  before it stayed up `stable_s`: a failed start. A child with a `fallback`
  (the draft worker: suffix drafts alone instead of a model draft) is started with
  it after `fallback_after` crashes in a row, once. After
  `max_quick_failures` failed starts in a row the child is marked failed and
  no longer restarted: a crash loop is a state an operator sees, not a
  silent restart every few seconds. An `essential` child (the gateway, a
  private Redis) that fails stops the stack instead (GaveUp).

Children run in their own sessions, so a terminal's Ctrl-C reaches only the
supervisor, which then stops them in order: gateway first (it drains its
streams), then draft workers (Celery's warm shutdown), verify workers,
telemetry, a draft link; a child that outlives its grace period is killed. If the
supervisor itself dies (kill -9), Linux kills every child with it
(PR_SET_PDEATHSIG), so none is left holding ports, memory and heartbeats.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from services.protocol import ChildStatus

logger = logging.getLogger(__name__)

STOP_ORDER = ("gateway", "draft-worker", "verify", "telemetry", "link", "redis")  # name prefixes, stopped in this order
CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGILL, signal.SIGBUS, signal.SIGABRT, signal.SIGFPE,
                           signal.SIGSYS, signal.SIGTRAP})
PR_SET_PDEATHSIG = 1


def restart_delay(consecutive_failures: int, base_s: float = 0.5, cap_s: float = 10.0) -> float:
    """Backoff before restart number `consecutive_failures` (1, 2, ...) of a child that keeps dying."""
    return min(cap_s, base_s * 2 ** max(0, consecutive_failures - 1))


def stop_rank(name: str) -> int:
    return next((rank for rank, prefix in enumerate(STOP_ORDER) if name.startswith(prefix)), len(STOP_ORDER))


def describe_exit(code: int | None) -> str:
    if code is None:
        return "running"
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def is_crash(code: int | None) -> bool:
    """Died of its own fault (a signal the process raised on itself), not killed from outside."""
    return code is not None and code < 0 and -code in CRASH_SIGNALS


def die_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """For preexec_fn: SIGKILL the child when the thread that started it ends (Linux; None elsewhere); exit at
    once if the parent is already gone (it died between fork and prctl). The starting thread must live as long
    as the child should."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: a forked child must not load libraries

    def arm() -> None:
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:
            os._exit(1)

    return arm


@dataclass
class Child:
    name: str
    command: list[str]
    env: dict[str, str]
    affinity: set[int] | None = None
    log_path: Path | None = None
    grace_s: float = 15.0  # SIGTERM to SIGKILL when stopping
    essential: bool = False  # a failed start of this child ends the stack (GaveUp)
    # (crash description, signal name) -> (env to restart with, what it changes in a few words, e.g. "draft ngram")
    fallback: Callable[[str, str], tuple[dict[str, str], str]] | None = None
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    failures: int = 0  # consecutive failed starts
    crashes: int = 0  # consecutive crash-signal deaths before it got going
    restarts: int = 0
    restart_at: float | None = None  # when a dead child is due to start again
    state: str = "starting"
    last_exit: str | None = None
    fallback_applied: str | None = None
    detail: str = ""

    def start(self) -> None:
        output = open(self.log_path, "a") if self.log_path else None  # noqa: SIM115 - the child owns it
        affinity = self.affinity
        arm = die_with_parent(os.getpid())
        if threading.current_thread() is not threading.main_thread():
            arm = None  # PDEATHSIG follows the starting thread, which may end before the supervisor

        def prepare() -> None:
            if arm is not None:
                arm()
            if affinity:
                os.sched_setaffinity(0, affinity)

        self.process = subprocess.Popen(
            self.command, env=self.env, stdout=output, stderr=subprocess.STDOUT if output else None,
            start_new_session=True,  # Ctrl-C goes to the supervisor, which stops children in order
            preexec_fn=prepare)
        if output is not None:
            output.close()  # the child has its own descriptor
        self.started_at = time.monotonic()
        self.restart_at = None
        self.state = "running"

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def status(self) -> ChildStatus:
        return ChildStatus(name=self.name, state=self.state, pid=self.process.pid if self.alive else 0,
                           restarts=self.restarts, failures=self.failures, last_exit=self.last_exit,
                           fallback=self.fallback_applied, log_path=str(self.log_path) if self.log_path else None,
                           detail=self.detail)


@dataclass
class Supervisor:
    children: dict[str, Child]
    on_restart: Callable[[str, int], None] | None = None  # (name, restarts so far)
    on_change: Callable[[Child | None], None] | None = None  # a child's state changed (None: a periodic refresh)
    stable_s: float = 30.0
    min_up_s: float = 5.0  # a kill from outside after this long restarts at once, uncounted
    max_quick_failures: int = 5
    fallback_after: int = 2  # crash-signal deaths at start before a child's fallback is applied
    base_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    on_stopped: list[Callable[[], None]] = field(default_factory=list)  # clean-ups once every child is stopped
    _stopping: bool = field(default=False, init=False)

    def start(self, skip: tuple[str, ...] = ()) -> None:
        for child in self.children.values():
            if child.name not in skip:
                child.start()
                self._changed(child)

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        return {name: child.process for name, child in self.children.items() if child.process is not None}

    def failed(self) -> list[Child]:
        return [child for child in self.children.values() if child.state == "failed"]

    def publish(self) -> None:
        """Tell on_change about every child again (the published states expire unless refreshed)."""
        self._changed(None)

    def _changed(self, child: Child | None) -> None:
        if self.on_change is not None:
            try:
                self.on_change(child)
            except Exception as exc:  # the state is for operators; Redis may be the child that is down
                logger.warning("could not publish the state of %s: %s", child.name if child else "children", exc)

    def check(self, now: float | None = None) -> list[str]:
        """One look at every child: schedule a restart for the dead, start those due. Returns the names
        started again. Marks a child failed after max_quick_failures failed starts; raises GaveUp when that
        child is essential."""
        now = time.monotonic() if now is None else now
        restarted = []
        for child in self.children.values():
            if self._stopping:
                break
            if child.state == "failed":
                continue
            if child.restart_at is None and not child.alive:
                self._on_death(child, now)
                if child.state == "failed":
                    continue
            if child.restart_at is not None and now >= child.restart_at:
                child.start()
                child.restarts += 1
                restarted.append(child.name)
                logger.warning("%s restarted (restart %d, pid %d)", child.name, child.restarts, child.process.pid)
                self._changed(child)
                if self.on_restart is not None:
                    try:
                        self.on_restart(child.name, child.restarts)
                    except Exception as exc:
                        logger.warning("could not record the restart of %s: %s", child.name, exc)
        return restarted

    def _on_death(self, child: Child, now: float) -> None:
        code = child.process.returncode if child.process is not None else None
        lived = now - child.started_at
        child.last_exit = describe_exit(code)
        got_going = lived >= self.stable_s
        # killed from outside after it got going (kill -9, the OOM killer): not a configuration error, restart
        # at once, however often it happens
        killed = code is not None and code < 0 and not is_crash(code) and lived >= self.min_up_s
        child.failures = 1 if got_going or killed else child.failures + 1
        child.crashes = 0 if got_going or not is_crash(code) else child.crashes + 1
        if child.crashes >= self.fallback_after and child.fallback is not None and child.fallback_applied is None:
            self._apply_fallback(child, lived)
        elif child.failures > self.max_quick_failures:
            self._mark_failed(child, lived)
            return
        delay = restart_delay(child.failures, self.base_backoff_s, self.max_backoff_s)
        child.restart_at = now + delay
        child.state = "restarting"
        logger.warning("%s exited (%s) after %.1fs; restarting in %.1fs", child.name, child.last_exit, lived, delay)
        self._changed(child)

    def _apply_fallback(self, child: Child, lived: float) -> None:
        reason = f"{child.name} crashed with {child.last_exit} {child.crashes} times in a row at start"
        overrides, child.fallback_applied = child.fallback(reason, child.last_exit or "crash")
        child.env = {**child.env, **overrides}
        child.failures = child.crashes = 0
        logger.error("%s (last after %.1fs); starting it with its fallback: %s", reason, lived,
                     child.fallback_applied)

    def _mark_failed(self, child: Child, lived: float) -> None:
        child.state = "failed"
        child.detail = (f"{child.name} exited {child.failures} times in a row within {self.stable_s:.0f}s of "
                        f"starting (last: {child.last_exit} after {lived:.1f}s); no longer restarted"
                        + (f"; see {child.log_path}" if child.log_path else ""))
        logger.error("%s", child.detail)
        self._changed(child)
        if child.essential:
            raise GaveUp(child.detail)

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
                child.state = "stopped"
        for clean_up in self.on_stopped:
            clean_up()

    def kill_all(self) -> None:
        """A second Ctrl-C: no more waiting."""
        self._stopping = True
        for child in self.children.values():
            if child.alive:
                child.process.kill()


class GaveUp(RuntimeError):
    """An essential child failed at start-up again and again: restarting it will not help."""


class StopSignals:
    """SIGINT and SIGTERM set `stop`; a second one kills every child of `supervisor` at once (no more waiting)."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.received: list[int] = []
        self.supervisor: Supervisor | None = None

    def install(self) -> "StopSignals":
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame) -> None:
        self.received.append(signum)
        if len(self.received) > 1 and self.supervisor is not None:
            self.supervisor.kill_all()
        self.stop.set()


def supervise(supervisor: Supervisor, stop: threading.Event, *, publish_every_s: float = 2.0) -> GaveUp | None:
    """Restart dying children until `stop` is set, publishing their states every few seconds (they expire in
    Redis unless refreshed: a dead supervisor leaves none). Returns why it gave up when an essential child
    failed, else None; stopping the children is the caller's."""
    published = 0.0
    try:
        while not stop.wait(0.5):
            supervisor.check()  # restarts a child that died; marks one that keeps failing at start
            if time.monotonic() - published > publish_every_s:
                supervisor.publish()
                published = time.monotonic()
    except GaveUp as exc:
        return exc
    return None
