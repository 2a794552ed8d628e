"""The supervisor of `mirror-sd up`, on real (tiny) child processes: restart with backoff, give up on a child
that never stays up, stop in order."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from services.supervisor import Child, GaveUp, Supervisor, restart_delay, stop_rank

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def child(name: str, command: list[str], tmp_path, env_extra: dict | None = None, **kwargs) -> Child:
    return Child(name, command, {**os.environ, **(env_extra or {})}, log_path=tmp_path / f"{name}.log", **kwargs)


def wait_for(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def test_restart_delay_doubles_to_a_cap():
    assert [restart_delay(n, 0.5, 10.0) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_stop_order_is_gateway_first_redis_last():
    names = ["telemetry", "redis", "verify-cpu-0", "draft-worker", "gateway"]
    assert sorted(names, key=stop_rank) == ["gateway", "draft-worker", "verify-cpu-0", "telemetry", "redis"]


def test_a_killed_child_is_restarted_after_its_backoff_and_counted(tmp_path):
    restarts = []
    supervisor = Supervisor({"draft-worker": child("draft-worker", SLEEPER, tmp_path),
                             "gateway": child("gateway", SLEEPER, tmp_path)},
                            on_restart=lambda name, count: restarts.append((name, count)), base_backoff_s=0.2)
    supervisor.start()
    try:
        first = supervisor.children["draft-worker"].process
        other = supervisor.children["gateway"].process
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=5)
        assert supervisor.check() == []  # dead, restart scheduled after the backoff
        wait_for(lambda: supervisor.check() == ["draft-worker"], timeout_s=5)
        second = supervisor.children["draft-worker"].process
        assert second.pid != first.pid and second.poll() is None
        assert supervisor.children["gateway"].process is other and other.poll() is None  # the rest untouched
        assert restarts == [("draft-worker", 1)]
    finally:
        supervisor.stop(grace_s=5)
    assert all(not c.alive for c in supervisor.children.values())


def test_a_child_that_never_stays_up_is_marked_failed_and_no_longer_restarted(tmp_path):
    failing = child("verify-cpu-0", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path)
    states = []
    supervisor = Supervisor({"verify-cpu-0": failing, "telemetry": child("telemetry", SLEEPER, tmp_path)},
                            base_backoff_s=0.01, max_backoff_s=0.01, max_quick_failures=3,
                            on_change=lambda c: states.append((c.name, c.state)) if c else None)
    supervisor.start()
    try:
        wait_for(lambda: supervisor.check() is not None and failing.state == "failed")
        for _ in range(20):  # no more restarts, and the rest of the stack goes on
            assert supervisor.check() == []
            time.sleep(0.01)
        assert failing.restarts == 3 and supervisor.children["telemetry"].alive
        assert supervisor.failed() == [failing]
        status = failing.status()
        assert status.state == "failed" and status.last_exit == "exit code 3" and status.pid == 0
        assert re.search(r"verify-cpu-0 exited 4 times .* \(last: exit code 3 .*\).*verify-cpu-0.log", status.detail)
        assert states[-1] == ("verify-cpu-0", "failed") and ("verify-cpu-0", "restarting") in states
    finally:
        supervisor.stop(grace_s=5)


def test_an_essential_child_that_never_stays_up_makes_the_supervisor_give_up_naming_it(tmp_path):
    failing = child("gateway", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path, essential=True)
    supervisor = Supervisor({"gateway": failing}, base_backoff_s=0.01, max_backoff_s=0.01, max_quick_failures=2)
    supervisor.start()
    with pytest.raises(GaveUp, match=r"gateway exited 3 times .* exit code 3.*gateway.log"):
        for _ in range(500):
            supervisor.check()
            time.sleep(0.01)


CRASHES_UNLESS_FALLBACK = [sys.executable, "-c", "import os, signal, time\n"
                           "if os.environ.get('MIRROR_SD_DRAFT') != 'ngram':\n"
                           "    time.sleep(0.3); os.kill(os.getpid(), signal.SIGSEGV)\n"
                           "time.sleep(120)"]


def test_a_child_crashing_at_start_is_restarted_with_its_fallback_after_two_crashes(tmp_path):
    reasons = []

    def fallback(reason: str, fault: str):
        reasons.append((reason, fault))
        return {"MIRROR_SD_DRAFT": "ngram"}, "draft ngram"

    crashing = child("draft-worker", CRASHES_UNLESS_FALLBACK, tmp_path, fallback=fallback)
    # it dies after min_up_s: a kill from outside that late would restart it uncounted, a crash does not
    supervisor = Supervisor({"draft-worker": crashing}, base_backoff_s=0.05, min_up_s=0.1, max_quick_failures=3)
    supervisor.start()
    try:
        wait_for(lambda: supervisor.check() is not None and crashing.fallback_applied is not None)
        assert reasons == [("draft-worker crashed with SIGSEGV 2 times in a row at start", "SIGSEGV")]
        wait_for(lambda: supervisor.check() == ["draft-worker"])
        time.sleep(0.6)  # longer than it took to crash
        assert supervisor.check() == [] and crashing.alive and crashing.state == "running"
        assert crashing.env["MIRROR_SD_DRAFT"] == "ngram" and crashing.restarts == 2
        status = crashing.status()
        assert status.fallback == "draft ngram" and status.last_exit == "SIGSEGV" and status.pid == crashing.process.pid
    finally:
        supervisor.stop(grace_s=5)


def test_a_crash_loop_without_a_fallback_ends_failed_with_its_signal_named(tmp_path):
    crashing = child("verify-cpu-0", CRASHES_UNLESS_FALLBACK, tmp_path, env_extra={"MIRROR_SD_DRAFT": "gguf"})
    supervisor = Supervisor({"verify-cpu-0": crashing}, base_backoff_s=0.01, max_backoff_s=0.01, min_up_s=0.1,
                            max_quick_failures=2)
    supervisor.start()
    wait_for(lambda: supervisor.check() is not None and crashing.state == "failed")
    assert crashing.restarts == 2 and "last: SIGSEGV" in crashing.detail


SUPERVISOR_SCRIPT = """
import os, sys, time
from services.supervisor import Child, Supervisor
sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
supervisor = Supervisor({name: Child(name, sleeper, dict(os.environ)) for name in ("gateway", "verify-cpu-0")})
supervisor.start()
print(" ".join(str(c.process.pid) for c in supervisor.children.values()), flush=True)
while True:
    supervisor.check()
    time.sleep(0.1)
"""


def test_children_die_with_a_killed_supervisor(tmp_path):
    import psutil

    from tests.conftest import REPO_ROOT

    process = subprocess.Popen([sys.executable, "-c", SUPERVISOR_SCRIPT], stdout=subprocess.PIPE, text=True,
                               cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        pids = [int(pid) for pid in process.stdout.readline().split()]
        children = [psutil.Process(pid) for pid in pids]
        assert len(children) == 2 and all(c.is_running() for c in children)
        process.kill()  # kill -9: no handler, no cleanup of its own
        process.wait(timeout=5)
        _, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, [c.pid for c in alive]
    finally:
        process.kill()


def test_stop_waits_for_each_group_and_kills_what_outlives_its_grace(tmp_path):
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(120)"]
    supervisor = Supervisor({"gateway": child("gateway", stubborn, tmp_path, grace_s=0.5),
                             "telemetry": child("telemetry", SLEEPER, tmp_path)})
    supervisor.start()
    wait_for(lambda: "up" in (tmp_path / "gateway.log").read_text())
    supervisor.stop()  # returns once each group has exited: the stubborn one killed after its grace
    assert supervisor.children["gateway"].process.returncode == -signal.SIGKILL
    assert supervisor.children["telemetry"].process.returncode == -signal.SIGTERM
    assert supervisor.check() == []  # a stopping supervisor restarts nothing


def test_a_child_killed_again_and_again_is_always_restarted_at_once(tmp_path):
    supervisor = Supervisor({"draft-worker": child("draft-worker", SLEEPER, tmp_path)}, max_quick_failures=2,
                            min_up_s=0.2, base_backoff_s=0.05)
    supervisor.start()
    try:
        for kill in range(4):  # more kills than quick failures allowed: a kill is not a failing start
            time.sleep(0.3)
            process = supervisor.children["draft-worker"].process
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=5)
            wait_for(lambda: supervisor.check() == ["draft-worker"], timeout_s=2)
        assert supervisor.children["draft-worker"].restarts == 4
    finally:
        supervisor.stop(grace_s=5)
