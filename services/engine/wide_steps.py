"""Which steps a verify worker runs on the draft worker's core too (worker.wide_threads), from timings here.

On one box the verify worker has `threads` torch threads and a remote draft worker the other cores. While no
draft drafts for its sessions (the plain route, target-only rounds) those cores are idle and a step may take
them: `wide` threads. Whether that pays depends on the step and on the machine. A prefill chunk or a step of
many rows is compute-bound and gains on any box; a step of a few one-token rows is bound by reading the
weights and may lose to the threads' waits on each other: on a 2-core AMD EPYC VM (1 vs 2 threads) one row of
one token took 47 vs 52 ms and 4 rows 79 vs 97, while 16 rows took 144 vs 120 and a 128-token prefill chunk
was about 1.7x faster; on a 2-core Xeon with AMX one row took 56 vs 35 ms and 8 rows 125 vs 73. So the
verify worker times one-token steps of 1, 2, 4 and 8 rows at both thread counts, in turns, at start-up
(cached like its profile) and, while no draft may be drafting for a session it holds (the plain route,
target-only rounds after round 0), runs wide every step of at least the fewest tokens from which wide was
faster at every larger size timed. Steps of WIDE_MIN_TOKENS or
more run wide whatever the timings said (measured before on every box seen); beside an opening or a drafted
block smaller ones do not (when they did whenever no draft was judged busy, the speculative route lost about
9% at one stream: a draft prefilling after an opening was not always seen).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import torch

from services.engine.measure_lock import measuring_turn
from services.engine.profile import (KEEP_ABOVE_SHARE, _prefilled, _time_step_once, cpu_share, keep,
                                     profile_cache_key, read_cached)
from services.models.engine import TargetEngine

logger = logging.getLogger(__name__)

WIDE_MIN_TOKENS = 16  # steps this big run wide (when no draft is busy) on every box
WIDE_ROWS = (1, 2, 4, 8)  # one-token rows per step, timed at both thread counts
WIDE_FORMAT = 1


def wide_min_tokens(timings: dict[str, float], *, rows: tuple[int, ...] = WIDE_ROWS,
                    ceiling: int = WIDE_MIN_TOKENS) -> int:
    """The fewest tokens a step must feed to run wide: the smallest row count timed from which the wide step
    ("wide_ms_<rows>") beat the narrow one ("narrow_ms_<rows>") at every larger count timed; `ceiling` when
    no such count (or a timing is missing)."""
    fewest = ceiling
    for count in sorted(rows, reverse=True):
        narrow, wide = timings.get(f"narrow_ms_{count}"), timings.get(f"wide_ms_{count}")
        if narrow is None or wide is None or wide >= narrow:
            break
        fewest = count
    return min(fewest, ceiling)


def plain_step_costs(timings: dict[str, float], fewest: int, *, rows: tuple[int, ...] = WIDE_ROWS) -> dict[str, float]:
    """What a target-only step of one-token rows costs here while no draft drafts ("plain_ms_<rows>", for the
    cost model's plain arm: services/speculative/cost_model.py): the wide timing from `fewest` tokens on (those steps
    run wide), the narrow one below; empty unless both were timed at every row count."""
    if any(f"{label}_ms_{count}" not in timings for count in rows for label in ("narrow", "wide")):
        return {}
    return {f"plain_ms_{count}": timings[f"wide_ms_{count}" if count >= fewest else f"narrow_ms_{count}"]
            for count in rows}


def measure_wide_steps(engine: TargetEngine, *, threads: int, wide: int, context_tokens: int = 64,
                       repeats: int = 3, rows: tuple[int, ...] = WIDE_ROWS) -> tuple[dict[str, float], float]:
    """({"narrow_ms_<rows>": ..., "wide_ms_<rows>": ...}, the lower of the two thread counts' CPU shares):
    the fastest of `repeats` one-token steps of each row count, narrow and wide taken in turns so that a slow
    stretch of a shared VM hits both. torch's thread count is left as it was."""
    before = torch.get_num_threads()
    sequences = _prefilled(engine, max(rows), context_tokens)
    timings: dict[str, list[float]] = {}
    spent = {threads: [0.0, 0.0], wide: [0.0, 0.0]}  # threads -> [cpu s, wall s]
    try:
        for _ in range(repeats + 1):  # the first pass warms each shape up at each thread count
            for count in rows:
                for label, num_threads in (("narrow", threads), ("wide", wide)):
                    torch.set_num_threads(num_threads)
                    cpu_started, wall_started = time.process_time(), time.perf_counter()
                    elapsed = _time_step_once(engine, sequences[:count], 1)
                    spent[num_threads][0] += time.process_time() - cpu_started
                    spent[num_threads][1] += time.perf_counter() - wall_started
                    timings.setdefault(f"{label}_ms_{count}", []).append(elapsed)
    finally:
        torch.set_num_threads(before)
        for sequence in sequences:
            sequence.release()
    share = min(cpu_share(cpu_s, wall_s, num_threads) for num_threads, (cpu_s, wall_s) in spent.items())
    return {name: round(min(values[1:]), 3) for name, values in timings.items()}, share


def cached_wide_steps(engine: TargetEngine, cache_dir: Path | None, *, threads: int, wide: int,
                      max_rows: int) -> dict[str, float]:
    """measure_wide_steps, kept in cache_dir/profiles beside the verify profile. Empty when this process did
    not have its cores while it measured (services/engine/profile.py): neither kept nor used."""
    key = hashlib.sha256(json.dumps({"format": WIDE_FORMAT, "profile": profile_cache_key(engine.target, max_rows),
                                     "threads": threads, "wide": wide, "rows": list(WIDE_ROWS)},
                                    sort_keys=True).encode()).hexdigest()[:16]
    path = None if cache_dir is None else Path(cache_dir) / "profiles" / f"wide-{key}.json"
    if (cached := read_cached(path, "wide-step")) is not None:
        return cached
    with measuring_turn(None if path is None else path.parent, "wide-step"):
        if (cached := read_cached(path, "wide-step")) is not None:
            return cached
        timings, share = measure_wide_steps(engine, threads=threads, wide=wide)
        if share < KEEP_ABOVE_SHARE:  # which side the contention hit is unknown: no figure of this run is used
            logger.warning("wide-step timings measured while other processes took this one's cores (%.0f%% of its "
                           "threads' time on a core): not used (steps of %d+ tokens run wide), measured again next "
                           "start", 100 * share, WIDE_MIN_TOKENS)
            return {}
        if path is not None:
            keep(path, timings)
    return timings
