"""The chaos drill: requests under load while workers are killed (kill -9), and optionally Redis restarted.

1. reference: every prompt once through the stack with `"route": "ar"` (the
   target alone, greedy), a few at a time;
2. chaos: the same prompts again (speculative route) at `concurrency`, while a
   killer picks a random live draft or verify worker on this host from the
   heartbeats, kill -9s it, waits for its role to be back at strength (the
   supervisor restarts it), and goes again, `kills` times. With
   `restart_redis` it also asks Redis to SHUTDOWN once mid-run (something,
   e.g. `mirror-sd up`'s supervisor or compose, must start it again); with
   `failover` (a `redis+sentinel://` redis_url) it kill -9s the Redis primary
   once mid-run instead (it must run on this host) and times the sentinels'
   promotion of a replica and the first request served after the kill;
3. report: completed, identical to the reference, lost (an error, a cut
   stream or no answer), doubled (more tokens than the reference: a round
   streamed twice), other mismatches, and the kills.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import redis

from services.bench.prompts import BenchPrompt
from services.drills.failover import first_served, kill_redis_primary
from services.gateway_client import GatewayHTTPError, astream_chat, chat_body
from services.redis_client import read_heartbeats
from services.redis_conn import primary_address

logger = logging.getLogger(__name__)


@dataclass
class Outcome:
    prompt_id: str
    token_ids: list[int] | None  # None: lost
    error: str | None = None


@dataclass
class Kill:
    role: str
    worker_id: str
    pid: int
    at_s: float
    back_after_s: float | None  # until the role had as many live workers again


@dataclass
class ChaosReport:
    requests: int
    completed: int
    identical: int
    lost: int
    doubled: int
    mismatched: int
    kills: list[Kill] = field(default_factory=list)
    redis_restart_s: float | None = None  # from SHUTDOWN to Redis answering again
    failover: dict | None = None  # old/new primary, promoted_s and served_s after the kill -9 (failover drill)
    errors: list[str] = field(default_factory=list)
    wall_s: float = 0.0

    def to_dict(self) -> dict:
        return {**{k: v for k, v in self.__dict__.items() if k != "kills"},
                "kills": [kill.__dict__ for kill in self.kills]}


def classify(reference: list[int] | None, outcome: Outcome) -> str:
    """identical | lost | doubled | mismatched (pure, for the report and its tests)."""
    if outcome.token_ids is None:
        return "lost"
    if reference is None:
        return "mismatched"
    if outcome.token_ids == reference:
        return "identical"
    return "doubled" if len(outcome.token_ids) > len(reference) else "mismatched"


async def _one(client: httpx.AsyncClient, model: str, prompt: BenchPrompt, max_tokens: int,
               route: str | None) -> Outcome:
    # the drill repeats prompts at once: no single-flight, no shared KV
    body = chat_body(model, prompt.prompt, max_tokens, temperature=0, cache_salt=uuid.uuid4().hex)
    if route:
        body["route"] = route
    for _ in range(30):  # 503 (a worker role briefly missing, load): come back as told
        try:
            answer = await astream_chat(client, body)
        except GatewayHTTPError as exc:
            if exc.status_code == 503:
                await asyncio.sleep(float(exc.retry_after or "1"))
                continue
            return Outcome(prompt.id, None, str(exc))
        except httpx.ConnectError:  # never reached the gateway (a restart): nothing was sent, ask again
            await asyncio.sleep(1.0)
            continue
        except httpx.HTTPError as exc:
            return Outcome(prompt.id, None, f"{type(exc).__name__}: {exc}")
        if answer.error is not None:
            return Outcome(prompt.id, None, answer.error.get("message", "error event"))
        if not answer.done or answer.token_ids is None:
            return Outcome(prompt.id, None, "stream ended without [DONE]")
        return Outcome(prompt.id, answer.token_ids)
    return Outcome(prompt.id, None, "503 or no connection for 30 attempts")


async def _run_all(url: str, model: str, prompts: list[BenchPrompt], concurrency: int, max_tokens: int,
                   route: str | None, timeout_s: float,
                   keep_going: Callable[[], bool] = lambda: False) -> list[Outcome]:
    """Every prompt once, `concurrency` at a time (closed loop); while keep_going() says so, round again
    over the prompts, so the load lasts as long as the chaos does."""
    limits = httpx.Limits(max_connections=concurrency + 4)
    outcomes: list[Outcome] = []
    counter = iter(range(10**9))
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        async def user() -> None:
            while True:
                index = next(counter)
                if index >= len(prompts) and not keep_going():
                    return
                outcomes.append(await _one(client, model, prompts[index % len(prompts)], max_tokens, route))

        await asyncio.gather(*(user() for _ in range(concurrency)))
    return outcomes


def live_workers(client: redis.Redis, host: str) -> list:
    try:
        return [b for b in read_heartbeats(client) if b.role in ("draft", "verify") and b.pid and b.host == host]
    except redis.RedisError:
        return []


class Killer(threading.Thread):
    def __init__(self, client: redis.Redis, *, kills: int, every_s: float, roles: tuple[str, ...],
                 restart_redis: bool, seed: int, recover_timeout_s: float = 120.0,
                 failover: tuple[str, str, str] | None = None) -> None:
        """failover: (redis_url, gateway url, model) to kill the Redis primary once mid-run."""
        super().__init__(daemon=True, name="chaos-killer")
        self.client, self.kills, self.every_s, self.roles = client, kills, every_s, roles
        self.restart_redis, self.recover_timeout_s = restart_redis, recover_timeout_s
        self.failover_on, self.failover = failover, None
        self.random = random.Random(seed)
        self.host = socket.gethostname()
        self.done: list[Kill] = []
        self.redis_restart_s: float | None = None
        self.stop = threading.Event()
        self.started = time.monotonic()

    def _pending(self) -> bool:
        return (len(self.done) < self.kills or (self.restart_redis and self.redis_restart_s is None)
                or (self.failover_on is not None and self.failover is None))

    def run(self) -> None:
        while self._pending() and not self.stop.wait(self.every_s):
            if self.restart_redis and self.redis_restart_s is None and len(self.done) >= self.kills // 2:
                self._restart_redis()
                continue
            if self.failover_on is not None and self.failover is None and len(self.done) >= self.kills // 2:
                self._fail_over(*self.failover_on)
                continue
            candidates = [b for b in live_workers(self.client, self.host) if b.role in self.roles]
            if not candidates:
                continue
            victim = self.random.choice(candidates)
            strength = sum(1 for b in candidates if b.role == victim.role)
            try:
                os.kill(victim.pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            at = time.monotonic()
            logger.warning("chaos: kill -9 %s %s (pid %d)", victim.role, victim.worker_id, victim.pid)
            back = None
            while time.monotonic() - at < self.recover_timeout_s and not self.stop.is_set():
                alive = [b for b in live_workers(self.client, self.host)
                         if b.role == victim.role and b.pid != victim.pid]
                if len(alive) >= strength:
                    back = time.monotonic() - at
                    break
                time.sleep(0.25)
            self.done.append(Kill(victim.role, victim.worker_id, victim.pid, at - self.started, back))

    def _fail_over(self, redis_url: str, url: str, model: str) -> None:
        old = primary_address(redis_url)
        pid, _ = kill_redis_primary(self.client)
        at = time.monotonic()
        logger.warning("chaos: kill -9 of the Redis primary %s (pid %d)", old, pid)
        promoted_s, new = None, None
        while time.monotonic() - at < self.recover_timeout_s and promoted_s is None:
            try:
                new = primary_address(redis_url)
                if new != old:
                    promoted_s = time.monotonic() - at
            except (redis.RedisError, OSError):
                pass
            time.sleep(0.1)
        served = first_served(url, model, self.recover_timeout_s)
        self.failover = {"old_primary": old, "new_primary": new, "promoted_s": promoted_s,
                         "served_s": None if served is None else time.monotonic() - at}

    def _restart_redis(self) -> None:
        at = time.monotonic()
        logger.warning("chaos: Redis SHUTDOWN")
        try:
            self.client.shutdown(nosave=False)
        except redis.RedisError:
            pass  # the connection drops as it goes
        while time.monotonic() - at < self.recover_timeout_s:
            try:
                if self.client.ping():
                    self.redis_restart_s = time.monotonic() - at
                    return
            except redis.RedisError:
                time.sleep(0.1)
        self.redis_restart_s = float("inf")


def run_chaos(url: str, client: redis.Redis, prompts: list[BenchPrompt], *, model: str, kills: int,
              concurrency: int, max_tokens: int, every_s: float, roles: tuple[str, ...] = ("draft", "verify"),
              restart_redis: bool = False, seed: int = 0, timeout_s: float = 600.0,
              failover_url: str | None = None) -> ChaosReport:
    """failover_url: the stack's `redis+sentinel://` URL, to kill its primary once mid-run."""
    references = asyncio.run(_run_all(url, model, prompts, max(1, min(concurrency, 4)), max_tokens, "ar", timeout_s))
    bad = [r for r in references if r.token_ids is None]
    if bad:
        raise RuntimeError(f"the reference pass failed before any chaos: {bad[0].prompt_id}: {bad[0].error}")
    killer = Killer(client, kills=kills, every_s=every_s, roles=roles, restart_redis=restart_redis, seed=seed,
                    failover=(failover_url, url, model) if failover_url else None)
    started = time.monotonic()
    killer.start()
    try:
        outcomes = asyncio.run(_run_all(url, model, prompts, concurrency, max_tokens, None, timeout_s,
                                        keep_going=killer.is_alive))
    finally:
        killer.stop.set()
        killer.join(timeout=30)
    reference = {r.prompt_id: r.token_ids for r in references}
    classes = [classify(reference.get(o.prompt_id), o) for o in outcomes]
    return ChaosReport(
        requests=len(outcomes), completed=sum(o.token_ids is not None for o in outcomes),
        identical=classes.count("identical"), lost=classes.count("lost"), doubled=classes.count("doubled"),
        mismatched=classes.count("mismatched"), kills=killer.done, redis_restart_s=killer.redis_restart_s,
        failover=killer.failover,
        errors=[f"{o.prompt_id}: {o.error}" for o in outcomes if o.error], wall_s=time.monotonic() - started)
