"""The draft worker's outbox: the driver's pushes go out on a thread of their own.

A push of blocks waits a round trip for Redis's reply; over a slow link that
is a whole RTT in which the driver thread would draft nothing. So the driver
hands each turn's pipeline (its blocks, and the reads riding with them:
the control look at cancellations, the look at suspect verify workers'
heartbeats) to this thread and drafts on at once: the speculation of the
next block starts while the block just sent travels. A job's replies come
back to the driver's thread (Outbox.outcomes), which applies them: the
driver itself waits on no round trip while blocks flow.

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

from services.link.meter import TRIP_BLOCKS, TRIP_LOOK

logger = logging.getLogger(__name__)


@dataclass
class Job:
    """Part of a pipeline: RPUSHes (queue, payload), then reads (a command and its arguments, e.g.
    ("EXISTS", key)), whose replies go to on_replies, called on the driver's thread (Outbox.outcomes)."""

    pushes: list[tuple[str, bytes]] = field(default_factory=list)
    reads: list[tuple] = field(default_factory=list)
    on_replies: Callable[[list], None] | None = None
    alone: str = TRIP_LOOK  # what a pipeline without pushes counts as (services/link/meter.py)


@dataclass
class Outcome:
    job: Job
    replies: list = field(default_factory=list)  # one a read
    error: Exception | None = None

    def apply(self) -> None:
        if self.error is None and self.job.on_replies is not None:
            self.job.on_replies(self.replies)


class Outbox(threading.Thread):
    def __init__(self, client: redis.Redis, wake: threading.Event, stopping: threading.Event,
                 on_round_trip: Callable[[str], None]) -> None:
        super().__init__(daemon=True, name="draft-outbox")
        self.client = client
        self.wake = wake
        self.stopping = stopping
        self.on_round_trip = on_round_trip
        self._jobs: queue.Queue[list[Job]] = queue.Queue()
        self._outcomes: deque[Outcome] = deque()

    def send(self, *jobs: Job) -> None:
        """Hand jobs over, to go in one pipeline; returns at once."""
        if jobs:
            self._jobs.put(list(jobs))

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
                handed = [self._jobs.get(timeout=0.5)]
            except queue.Empty:
                continue
            while True:  # and every job handed over meanwhile: one pipeline for all
                try:
                    handed.append(self._jobs.get_nowait())
                except queue.Empty:
                    break
            jobs = [job for batch in handed for job in batch]
            try:
                self._outcomes.extend(self._execute(jobs))
                if any(job.reads for job in jobs):
                    self.wake.set()
            except redis.RedisError as exc:
                self._outcomes.extend(Outcome(job, error=exc) for job in jobs)
                self.wake.set()
            except Exception as exc:  # never lose the thread: the driver hears of it as of a Redis error
                logger.exception("draft outbox: a push failed")
                self._outcomes.extend(Outcome(job, error=exc) for job in jobs)
                self.wake.set()
            finally:
                for _ in handed:
                    self._jobs.task_done()

    def _execute(self, jobs: list[Job]) -> list[Outcome]:
        with self.client.pipeline(transaction=False) as pipe:
            for job in jobs:
                for queue_name, payload in job.pushes:
                    pipe.rpush(queue_name, payload)
                for command in job.reads:
                    pipe.execute_command(*command)
            self.on_round_trip(TRIP_BLOCKS if any(job.pushes for job in jobs) else jobs[0].alone)
            replies = pipe.execute()
        outcomes, at = [], 0
        for job in jobs:
            at += len(job.pushes)
            outcomes.append(Outcome(job, replies=replies[at:at + len(job.reads)]))
            at += len(job.reads)
        return outcomes
