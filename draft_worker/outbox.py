"""The draft worker's outbox: the driver's pushes go out on a thread of their own.

A push of blocks waits a round trip for Redis's reply; over a slow link that
is a whole RTT in which the driver thread would draft nothing. So the driver
hands each turn's pipeline (its blocks, and the control look riding with
them) to this thread and drafts on at once: the speculation of the next
block starts while the block just sent travels.

Jobs go out in the order handed over, on one thread, so a session's blocks
reach Redis in order (a chained block after its parent). Jobs handed over
while a pipeline is out go together in the next one: a busy outbox costs a
push at most one round trip of waiting, however many jobs queue behind it
(one pipeline a job would cost each a round trip more than the one before).
The driver's rare direct writes (a failover's resend, a stream's close)
flush the outbox first, so they too come after what was handed over before.
A job that fails (Redis away) is reported back: the driver then backs off
and sends every block in flight again, as after any outage (a verify worker
answers a round it already committed with a resync verdict, so a resend
never commits twice).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """One pipeline: RPUSHes (queue, payload), then EXISTS of each `look` key."""

    pushes: list[tuple[str, bytes]] = field(default_factory=list)
    look_keys: list[str] = field(default_factory=list)
    context: object = None  # the driver's, handed back with the outcome (the sessions looked at)


@dataclass
class Outcome:
    job: Job
    look_flags: list = field(default_factory=list)  # one reply per look key
    error: Exception | None = None


class Outbox(threading.Thread):
    def __init__(self, client: redis.Redis, wake: threading.Event, stopping: threading.Event,
                 on_round_trip: Callable[[], None]) -> None:
        super().__init__(daemon=True, name="draft-outbox")
        self.client = client
        self.wake = wake
        self.stopping = stopping
        self.on_round_trip = on_round_trip
        self._jobs: queue.Queue[Job] = queue.Queue()
        self._outcomes: deque[Outcome] = deque()

    def send(self, job: Job) -> None:
        """Hand a job over; returns at once."""
        self._jobs.put(job)

    def flush(self) -> None:
        """Return once every job handed over so far has gone (or failed), or the worker is stopping."""
        done = self._jobs.all_tasks_done
        with done:
            while self._jobs.unfinished_tasks and not self.stopping.is_set():
                done.wait(0.1)

    def outcomes(self) -> list[Outcome]:
        """What came back since the last call: look replies, failures."""
        taken = []
        while self._outcomes:
            taken.append(self._outcomes.popleft())
        return taken

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                jobs = [self._jobs.get(timeout=0.5)]
            except queue.Empty:
                continue
            while True:  # and every job handed over meanwhile: one pipeline for all
                try:
                    jobs.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            try:
                self._outcomes.extend(self._execute(jobs))
                if any(job.look_keys for job in jobs):
                    self.wake.set()
            except redis.RedisError as exc:
                self._outcomes.extend(Outcome(job, error=exc) for job in jobs)
                self.wake.set()
            except Exception as exc:  # never lose the thread: the driver hears of it as of a Redis error
                logger.exception("draft outbox: a push failed")
                self._outcomes.extend(Outcome(job, error=exc) for job in jobs)
                self.wake.set()
            finally:
                for _ in jobs:
                    self._jobs.task_done()

    def _execute(self, jobs: list[Job]) -> list[Outcome]:
        with self.client.pipeline(transaction=False) as pipe:
            for job in jobs:
                for queue_name, payload in job.pushes:
                    pipe.rpush(queue_name, payload)
                for key in job.look_keys:
                    pipe.exists(key)
            self.on_round_trip()
            replies = pipe.execute()
        outcomes, at = [], 0
        for job in jobs:
            at += len(job.pushes)
            outcomes.append(Outcome(job, look_flags=replies[at:at + len(job.look_keys)]))
            at += len(job.look_keys)
        return outcomes
