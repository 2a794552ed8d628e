"""`mirror-sd bench --overhead`: what the stack's machinery costs, measured against a near-free target.

It starts a stack of its own (a private Redis, a gateway, one verify worker serving `random:tiny` drafted by
`synthetic:1.0` for the speculative route, placement local, telemetry: `mirror-sd up` on a small box), decodes
every prompt target-only in its own process first (the floor, and the greedy reference every stream is checked
against and the synthetic draft drafts from), then runs each level of streams in flight through the plain route
(stack-ar) and the speculative one (stack). Per level and route: tokens/s, a stream's time per token over the
in-process one, TTFT; the verify worker's turn split into stages per step and per row (its heartbeat's
stage_times: verify_worker/figures.py StageTimes); CPU time per streamed token of the gateway, the verify worker
and this process's client. Then one more pass of a level per route under py-spy (services/bench/profiling.py),
untimed: the figures come from the passes without a profiler attached.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from services.bench import profiling
from services.bench.concurrency import LevelRow, check_greedy, level_prompts, summarize
from services.bench.load import run_level
from services.bench.overhead_figures import (
    InProcess,
    StepSplit,
    cpu_us_per_token,
    deltas,
    in_process,
    step_split,
    top_text,
    x_in_process,
)
from services.bench.prompts import BenchPrompt
from services.engine import GenerationOptions, generate
from services.models.drafters import DraftSource
from services.models.loading import LoadedModel
from services.models.tokenization import encode_prompt

logger = logging.getLogger(__name__)

OVERHEAD_TARGET = "random:tiny"
OVERHEAD_DRAFT = "synthetic:1.0"
DEFAULT_LEVELS = "1,8,32,64"
DEFAULT_PROMPTS = 16  # without --limit: the first 16 of the balanced order (a level sends max(16, C) requests)
ROUTES = {"stack-ar": "ar", "stack": None}  # the bench's route name -> the request's mirror_sd route
WARMUP_TOKENS = 8
PROCESSES = ("gateway", "verify-worker")


@dataclass
class OverheadConfig:
    levels: list[int]
    prompts: list[BenchPrompt]
    max_tokens: int = 64
    requests: int | None = None  # per level; default max(prompts, C)
    warmup: int = 1  # untimed passes of each level (C requests, 8 tokens) by each route before its timed one
    profile: bool = True
    profile_level: int | None = None  # the level profiled (default: the largest)
    chat: bool = True
    ready_timeout_s: float = 180.0


@dataclass
class OverheadRow:
    route: str
    concurrency: int
    level: LevelRow
    split: StepSplit
    cpu_us_per_token: dict[str, float | None]  # gateway, verify-worker, bench client
    x_in_process: float | None


@dataclass
class Profiles:
    tool: str  # "py-spy", or "none"
    level: int | None
    files: dict[str, list[str]] = field(default_factory=dict)  # "<route> <process>" -> paths relative to the report
    tops: dict[str, str] = field(default_factory=dict)  # "<route> <process>" -> top-functions text
    note: str = ""


@dataclass
class RunningStack:
    url: str
    redis_url: str
    pids: dict[str, int]  # gateway, verify-worker


def baseline(target: LoadedModel, prompts: list[BenchPrompt], encoded: dict[str, list[int]],
             max_tokens: int) -> tuple[InProcess, dict[str, list[int]]]:
    """Target-only decoding of each distinct prompt in this process (after one 8-token warm-up): its figures and
    each prompt's greedy output (what every stream must equal, and what the synthetic draft drafts from)."""
    unique = list({prompt.id: prompt for prompt in prompts})
    generate(target, DraftSource("none"), encoded[unique[0]], GenerationOptions(max_new_tokens=WARMUP_TOKENS))
    options = GenerationOptions(max_new_tokens=max_tokens)
    results = {pid: generate(target, DraftSource("none"), encoded[pid], options) for pid in unique}
    return in_process(list(results.values())), {pid: result.token_ids for pid, result in results.items()}


@contextmanager
def overhead_stack(workdir: Path, log_dir: Path, ready_timeout_s: float = 180.0) -> Iterator[RunningStack]:
    """A stack of its own on a private Redis, a free port and a database in `workdir`; stopped on leaving."""
    from services.stack import PrivateRedis, free_port, start_stack
    from services.storage.db import init_db

    redis_server = PrivateRedis().start()
    try:
        port = free_port()
        database_url = f"sqlite:///{workdir / 'overhead.db'}"
        init_db(database_url)
        env = {"MIRROR_SD_TARGET": OVERHEAD_TARGET, "MIRROR_SD_DRAFT": OVERHEAD_DRAFT,
               "MIRROR_SD_DATABASE_URL": database_url, "MIRROR_SD_GATEWAY__AUTH_DISABLED": "true",
               # the speculative route drafts while its blocks are accepted (all are, at 1.0); the cost policy
               # could learn that a near-free target's step is no dearer than drafting and go plain
               "MIRROR_SD_SPECULATIVE__BLOCK_POLICY": "acceptance"}
        log_dir.mkdir(parents=True, exist_ok=True)
        supervisor, _ = start_stack(redis_url=redis_server.url, port=port, draft=OVERHEAD_DRAFT, env=env,
                                    log_dir=log_dir, placement="local", ready_timeout_s=ready_timeout_s)
        try:
            pids = {name: supervisor.children[name].process.pid for name in PROCESSES}
            yield RunningStack(f"http://127.0.0.1:{port}", redis_server.url, pids)
        finally:
            supervisor.stop(grace_s=10)
    finally:
        redis_server.stop()


def verify_totals(redis_url: str, *, sent_after: float, wait_s: float = 5.0) -> tuple[dict, dict]:
    """The verify workers' cumulative step counters and stage times, summed, from heartbeats sent after
    `sent_after` (wall clock; a heartbeat is up to an interval old)."""
    from services.redis_client import read_heartbeats
    from services.redis_conn import connect

    client = connect(redis_url)
    deadline = time.monotonic() + wait_s
    while True:
        beats = [beat for beat in read_heartbeats(client) if beat.role == "verify"]
        if (beats and all(beat.sent_at > sent_after for beat in beats)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    counters: dict[str, float] = {}
    stages: dict[str, float] = {}
    for beat in beats:
        for totals, values in ((counters, beat.step_counters), (stages, beat.stage_times)):
            for key, value in values.items():
                totals[key] = totals.get(key, 0) + value
    return counters, stages


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """user + system CPU seconds of each process so far (psutil reads /proc/<pid>/stat)."""
    seconds = {}
    for name, pid in pids.items():
        times = psutil.Process(pid).cpu_times()
        seconds[name] = times.user + times.system
    return seconds


def measure(route: str, stack: RunningStack, model: str, batch: list[BenchPrompt], concurrency: int,
            max_tokens: int, checks: tuple, baseline_figures: InProcess) -> OverheadRow:
    """One timed pass of a level through one route; checks: (target, reference, encoded) for the greedy check."""
    pids = {**stack.pids, "bench client": psutil.Process().pid}
    counters_before, stages_before = verify_totals(stack.redis_url, sent_after=time.time())
    cpu_before = cpu_seconds(pids)
    run = run_level(stack.url, model, batch, concurrency, max_tokens=max_tokens, route=ROUTES[route], mode=route)
    cpu_after = cpu_seconds(pids)
    counters_after, stages_after = verify_totals(stack.redis_url, sent_after=time.time())
    target, reference, encoded = checks
    row = summarize(run, sum(found.fatal for found in check_greedy(run, reference, encoded, target)))
    return OverheadRow(
        route=route, concurrency=concurrency, level=row,
        split=step_split(deltas(stages_before, stages_after), deltas(counters_before, counters_after)),
        cpu_us_per_token={name: cpu_us_per_token(cpu_after[name] - cpu_before[name], row.tokens) for name in pids},
        x_in_process=x_in_process(row.tpot_p50_ms, baseline_figures))


def warm(stack: RunningStack, model: str, batch: list[BenchPrompt], concurrency: int, passes: int) -> None:
    for _ in range(passes):
        for route in ROUTES:
            run_level(stack.url, model, batch[:concurrency], concurrency, max_tokens=WARMUP_TOKENS,
                      route=ROUTES[route])


def profile_level(stack: RunningStack, model: str, batch: list[BenchPrompt], concurrency: int, max_tokens: int,
                  folder: Path) -> Profiles:
    """One more pass of the level per route with py-spy recording the gateway and the verify worker."""
    why_not = profiling.available(stack.pids["verify-worker"])
    if why_not is not None:
        return Profiles(tool="none", level=concurrency, note=why_not)
    folder.mkdir(parents=True, exist_ok=True)
    found = Profiles(tool="py-spy", level=concurrency)
    for route in ROUTES:
        recordings = {name: profiling.Recording(name, pid, folder / f"{route}-c{concurrency}-{name}.folded").start()
                      for name, pid in stack.pids.items()}
        dumps = {name: folder / f"{route}-c{concurrency}-{name}.dump.txt" for name in stack.pids}
        timer = threading.Timer(0.5, dump_all, args=(stack.pids, dumps))  # mid-level, while the streams run
        timer.start()
        run_level(stack.url, model, batch, concurrency, max_tokens=max_tokens, route=ROUTES[route], mode=route)
        timer.join()
        for name, recording in recordings.items():
            key = f"{route} {name}"
            folded = recording.stop()
            top = folder / f"{route}-c{concurrency}-{name}.top.txt"
            found.tops[key] = top_text(f"{key} at C={concurrency}", folded)
            top.write_text(found.tops[key])
            found.files[key] = [f"{folder.name}/{path.name}" for path in (recording.folded, top, dumps[name])
                                if path.is_file()]
    return found


def dump_all(pids: dict[str, int], paths: dict[str, Path]) -> None:
    for name, path in paths.items():
        profiling.dump(pids[name], path)


def run_overhead_bench(config: OverheadConfig, target: LoadedModel, out_dir: Path,
                       progress=print) -> tuple[InProcess, list[OverheadRow], Profiles]:
    encoded = {p.id: encode_prompt(target.tokenizer, p.prompt, chat=config.chat) for p in config.prompts}
    progress(f"in process: target-only decoding of {len(set(encoded))} prompts, one at a time")
    floor, reference = baseline(target, config.prompts, encoded, config.max_tokens)
    progress(f"in process: {floor.tokens_per_s} tok/s, TPOT p50 {floor.tpot_p50_ms} ms")
    rows: list[OverheadRow] = []
    profiles = Profiles(tool="none", level=None, note="not asked (--no-profile)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mirror-sd-overhead-") as workdir, \
            overhead_stack(Path(workdir), out_dir / "logs", config.ready_timeout_s) as stack:
        progress(f"stack up at {stack.url} (pids {stack.pids})")
        publish(stack.redis_url, reference, encoded)
        for concurrency in config.levels:
            batch = level_prompts(config.prompts, concurrency, config.requests)
            warm(stack, OVERHEAD_TARGET, batch, concurrency, config.warmup)
            for route in ROUTES:
                row = measure(route, stack, OVERHEAD_TARGET, batch, concurrency, config.max_tokens,
                              (target, reference, encoded), floor)
                rows.append(row)
                progress(f"C={concurrency:<3} {route:8} {row.level.tokens_per_s:8.1f} tok/s  TPOT p50 "
                         f"{row.level.tpot_p50_ms} ms (x{row.x_in_process} in process)  rows/step "
                         f"{row.split.rows_per_step}  machinery {row.split.machinery_ms} ms/step  gateway "
                         f"{row.cpu_us_per_token.get('gateway')} us CPU/token")
        if config.profile:
            level = config.profile_level or max(config.levels)
            progress(f"profiling C={level} (one more pass per route, untimed)")
            profiles = profile_level(stack, OVERHEAD_TARGET, level_prompts(config.prompts, level, config.requests),
                                     level, config.max_tokens, out_dir / "profiles")
            if profiles.note:
                progress(f"no profile: {profiles.note}")
    return floor, rows, profiles


def publish(redis_url: str, reference: dict[str, list[int]], encoded: dict[str, list[int]]) -> None:
    """The synthetic draft drafts from the target's greedy output (services/synthetic.py)."""
    from services.redis_conn import connect
    from services.synthetic import publish_reference

    client = connect(redis_url)
    for prompt_id, output_ids in reference.items():
        publish_reference(client, encoded[prompt_id], output_ids)
