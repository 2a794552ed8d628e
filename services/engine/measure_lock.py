"""One measurement at a time per box: the workers `mirror-sd up` starts together (two verify workers and a
draft worker on two cores, say) each time their start-up profiles. Measured at once, they take each other's
cores: every profile reads slow, none is kept (services/engine/profile.py keeps only what a process measured
with its cores), and each start measures again, for minutes. So a process measures while it holds an advisory
lock beside the profiles (filelock's: flock where the file system has it); the next one waits its turn and then
usually finds the profile it wanted already kept. The kernel drops the lock of a process that dies, so a killed
worker holds no one up.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

logger = logging.getLogger(__name__)

LOCK_NAME = ".measuring.lock"
WAIT_S = 600.0  # after this, measure anyway (a measurement that hangs should not stop every start)
POLL_S = 0.2


@contextmanager
def measuring_turn(folder: Path | None, what: str, *, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold this box's measuring turn (the lock in `folder`) for the block; None: no lock (nothing shared)."""
    if folder is None:
        yield
        return
    lock, held = FileLock(folder / LOCK_NAME), False
    try:
        folder.mkdir(parents=True, exist_ok=True)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            logger.info("the %s profile waits for another process measuring on this box", what)
            lock.acquire(timeout=wait_s, poll_interval=POLL_S)
        held = True
    except Timeout:
        logger.warning("waited %.0f s for another process's measurement: measuring the %s profile beside it",
                       wait_s, what)
    except OSError as exc:  # a read-only cache folder: measure without a turn, as before there was one
        logger.warning("no measuring lock in %s (%s): measuring the %s profile without one", folder, exc, what)
    try:
        yield
    finally:
        if held:
            lock.release()
