"""The supervisor of `mirror-sd up`, on real (tiny) child processes: restart with backoff, give up on a child
that never stays up, stop in order."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from services.supervisor import Child, GaveUp, Supervisor, restart_delay, stop_rank

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def child(name: str, command: list[str], tmp_path, **kwargs) -> Child:
    return Child(name, command, dict(os.environ), log_path=tmp_path / f"{name}.log", **kwargs)


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


def test_a_child_that_never_stays_up_makes_the_supervisor_give_up_naming_it(tmp_path):
    failing = child("verify-cpu-0", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path)
    supervisor = Supervisor({"verify-cpu-0": failing}, base_backoff_s=0.01, max_backoff_s=0.01,
                            max_quick_failures=3)
    supervisor.start()
    with pytest.raises(GaveUp, match=r"verify-cpu-0 exited 4 times .* code 3.*verify-cpu-0.log"):
        for _ in range(500):
            supervisor.check()
            time.sleep(0.01)
    assert failing.restarts == 3


def test_stop_waits_for_each_group_and_kills_what_outlives_its_grace(tmp_path):
    stubborn = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "print('up', flush=True); time.sleep(120)"]
    supervisor = Supervisor({"gateway": child("gateway", stubborn, tmp_path, grace_s=0.5),
                             "telemetry": child("telemetry", SLEEPER, tmp_path)})
    supervisor.start()
    wait_for(lambda: "up" in (tmp_path / "gateway.log").read_text())
    started = time.monotonic()
    supervisor.stop()
    assert time.monotonic() - started < 10
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
