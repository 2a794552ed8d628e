"""services/startup.py: `up` waits for a stack while its children work, and gives up once they stall."""

from __future__ import annotations

import subprocess
import sys

from services.startup import StartupDeadline, cpu_seconds


def test_work_moves_the_deadline_and_idleness_lets_it_pass():
    deadline = StartupDeadline(10.0, now=0.0)
    deadline.poll(0.0, cpu_s=0.0)
    for second in range(1, 31):  # 30 s of a verify worker loading a model on one core
        deadline.poll(float(second), cpu_s=float(second))
        assert not deadline.expired(float(second))
    deadline.poll(31.0, cpu_s=30.1)  # then idle children: a heartbeat, a probe
    assert not deadline.expired(39.9)
    assert deadline.expired(40.0)  # 10 s after the last poll that saw work


def test_a_few_percent_of_a_core_is_not_progress():
    deadline = StartupDeadline(10.0, now=0.0)
    for second in range(12):
        deadline.poll(float(second), cpu_s=0.05 * second)
    assert deadline.expired(10.0)


def test_work_never_moves_the_deadline_past_the_cap():
    deadline = StartupDeadline(10.0, now=0.0, cap_s=25.0)
    for second in range(40):
        deadline.poll(float(second), cpu_s=2.0 * second)
    assert deadline.expired(25.0)


def test_cpu_seconds_counts_a_busy_child_and_skips_a_gone_one():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                             "while time.process_time() < end: pass\ntime.sleep(30)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        for _ in range(100):
            if cpu_seconds([busy, gone]) >= 0.3:
                break
            subprocess.run(["sleep", "0.05"])
        assert cpu_seconds([busy, gone]) >= 0.3
    finally:
        busy.kill()
        busy.wait()
