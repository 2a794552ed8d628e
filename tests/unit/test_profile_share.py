"""A profile measured while other processes had this one's cores is used, never cached."""

from __future__ import annotations

import json
import time

from services.engine.profile import KEEP_ABOVE_SHARE, _cached, cpu_share


def test_cpu_share_is_cpu_time_over_threads_times_wall():
    assert cpu_share(2.0, 1.0, 2) == 1.0
    assert abs(cpu_share(1.38, 1.0, 2) - 0.69) < 1e-9  # one thread too many on two cores, as measured here
    assert cpu_share(0.0, 0.0, 1) == 1.0 and cpu_share(1.0, 1.0, 0) == 1.0  # nothing measured: no verdict


def _busy(seconds: float) -> dict:
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        pass
    return {"verify_ms_1": 1.0}


def test_a_profile_measured_with_its_core_is_kept_and_one_measured_without_it_is_not(tmp_path):
    kept = tmp_path / "kept.json"
    assert _cached(kept, "device", lambda: _busy(0.3), threads=1) == {"verify_ms_1": 1.0}
    assert json.loads(kept.read_text()) == {"verify_ms_1": 1.0}
    # the process was off its core for most of the time it measured (a sleep stands for another process)
    starved = tmp_path / "starved.json"

    def measured_off_core() -> dict:
        time.sleep(0.3)
        return _busy(0.05)

    assert _cached(starved, "device", measured_off_core, threads=1) == {"verify_ms_1": 1.0}
    assert not starved.exists()
    assert KEEP_ABOVE_SHARE > 0.69  # the contended share measured on a 2-core box is below it


MEASURE_AT_ONCE = """
import json, os, sys, time
from pathlib import Path
from services.engine.profile import _cached
folder = Path(sys.argv[1])
(folder / f"ready-{os.getpid()}").touch()
while not (folder / "go").exists():
    time.sleep(0.01)

def measure():
    with open(folder / "measurements", "a") as log:
        log.write(f"{os.getpid()} start {time.time()}\\n")
    time.sleep(1.0)
    with open(folder / "measurements", "a") as log:
        log.write(f"{os.getpid()} end {time.time()}\\n")
    return {"measured_by": os.getpid()}

print(json.dumps(_cached(folder / "profiles" / "device.json", "device", measure, 0)))
"""


def test_workers_starting_together_measure_one_at_a_time_and_the_next_reads_the_kept_profile(tmp_path):
    import subprocess
    import sys

    workers = [subprocess.Popen([sys.executable, "-c", MEASURE_AT_ONCE, str(tmp_path)], stdout=subprocess.PIPE,
                                text=True) for _ in range(2)]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready-*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "go").touch()  # both ask for the profile at the same moment
    outputs = [json.loads(worker.communicate(timeout=60)[0]) for worker in workers]
    lines = (tmp_path / "measurements").read_text().split()
    assert lines[1::3] == ["start", "end"]  # one measurement, by one of the two
    assert outputs[0] == outputs[1] == {"measured_by": int(lines[0])}
    assert json.loads((tmp_path / "profiles" / "device.json").read_text()) == outputs[0]


def test_a_cache_folder_that_cannot_hold_the_lock_measures_without_it(tmp_path):
    from services.engine.measure_lock import measuring_turn

    blocked = tmp_path / "a-file"
    blocked.write_text("")  # the lock's folder would be a regular file: no lock can be made there
    entered = []
    with measuring_turn(blocked / "profiles", "device"):
        entered.append(True)
    assert entered == [True]


def test_a_turn_held_past_the_wait_is_measured_beside_it(tmp_path):
    from filelock import FileLock

    from services.engine.measure_lock import LOCK_NAME, measuring_turn

    folder = tmp_path / "profiles"
    folder.mkdir()
    holder = FileLock(folder / LOCK_NAME)
    holder.acquire()  # another process's turn that never ends (a hung measurement)
    try:
        started = time.monotonic()
        with measuring_turn(folder, "device", wait_s=0.3):
            waited = time.monotonic() - started
        assert 0.3 <= waited < 5  # it waited its turn, then measured anyway
        assert holder.is_locked  # and left the other's lock alone
    finally:
        holder.release()
