"""Profiles of a stack's processes for `mirror-sd bench --overhead`: py-spy (a sampling profiler that reads a
running process from outside: no code in the process, no restart) records each process for the length of a
level, as folded stacks (speedscope.app and flamegraph tools open them), and one `py-spy dump` of its threads
mid-level. py-spy needs to ptrace the process: as root, or with kernel.yama.ptrace_scope 0 for one's own
processes; `available()` says when it cannot, and the bench then reports no profile and why.
"""

from __future__ import annotations

import logging
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SAMPLE_RATE_HZ = 250


def py_spy_binary() -> str | None:
    """py-spy beside this interpreter (the project's venv installs it), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def available(pid: int) -> str | None:
    """None when py-spy can read process `pid`, else why not (no binary, no permission: its message)."""
    binary = py_spy_binary()
    if binary is None:
        return "py-spy is not installed (pip install py-spy)"
    try:
        done = subprocess.run([binary, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"py-spy dump failed: {exc}"
    if done.returncode != 0:
        return f"py-spy cannot read pid {pid}: {(done.stderr or done.stdout).strip()[:300]}"
    return None


@dataclass
class Recording:
    """py-spy recording one process into `folded` until stop()."""

    name: str
    pid: int
    folded: Path
    process: subprocess.Popen | None = None
    log: list[str] = field(default_factory=list)

    def start(self) -> "Recording":
        # --function: samples aggregated by function, not by line, so a function's total is one figure;
        # --idle off (the default): only samples on the CPU, so a blocked wait on Redis is not a cost
        command = [py_spy_binary() or "py-spy", "record", "--pid", str(self.pid), "--format", "raw", "--function",
                   "--rate", str(SAMPLE_RATE_HZ), "--nonblocking", "--output", str(self.folded)]
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return self

    def stop(self, timeout_s: float = 30.0) -> list[str]:
        """Ends the recording (SIGINT: py-spy writes what it sampled) and returns the folded lines."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                output, _ = self.process.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                output, _ = self.process.communicate()
            self.log.append(output or "")
        return self.folded.read_text().splitlines() if self.folded.is_file() else []


def dump(pid: int, path: Path) -> Path | None:
    """One `py-spy dump` of every thread of `pid` (with locals off) into `path`; None when it failed."""
    binary = py_spy_binary()
    if binary is None:
        return None
    try:
        done = subprocess.run([binary, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("py-spy dump of %d failed: %s", pid, exc)
        return None
    path.write_text(done.stdout if done.returncode == 0 else done.stderr)
    return path if done.returncode == 0 else None
