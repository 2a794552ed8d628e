"""Device profiles measured at start-up: what a target step over (rows, tokens per row) costs here, and what
one draft token costs. (Just over 300 lines: measuring, caching and the contended-CPU guard of each profile
together.)

The verify curve (`verify_ms_1` .. `verify_ms_9`: one row of n tokens) says
what a block costs a lone stream; the step grid (`step_ms_<rows>x<n>`) says
what it costs under load, where the controller weighs speculation against
plain batched decoding (services/speculative/cost_model.py). Workers publish
both in their heartbeats. Measuring the grid takes seconds, so a worker keeps
it on disk, keyed by everything that changes it (model, precision, layout,
device, threads, torch version, the grid itself); a draft worker keeps its
draft's cost the same way (a llama.cpp draft: its GGUF file, threads, slots).

A profile measured while other processes took this one's cores (a test
run, a second worker measuring on the same cores, a build) is used for that
run but never kept: the process's CPU time over the measurement, against
its threads x the wall time, says whether it had its cores (1.00 alone on
its cores here; 0.69 with one thread too many on two cores). A cached
profile measured under load would have the cost model misjudge speculation
for good (a 2x verify curve and a 3.6x draft cost were seen so).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from services.engine.measure_lock import measuring_turn
from services.models.engine import TargetEngine, TorchEngine
from services.models.decoder import ForwardRow
from services.models.kv_store import SequenceKV
from services.models.drafters.batched import DraftCall, propose_many
from services.models.drafters.factory import DraftSource
from services.models.synthetic_spec import parse_synthetic_spec
from services.models.loading import LoadedModel
from services.speculative.cost_model import CostModel
from services.speculative.params import SamplingParams

logger = logging.getLogger(__name__)

VERIFY_SIZES = tuple(range(1, 10))  # 1 token (target alone) up to a block of 8 + 1
STEP_ROWS = (2, 4, 8, 16, 32)
STEP_SIZES = (1, 2, 3, 5, 9)
PROFILE_FORMAT = 4  # 3: cells timed in interleaved passes; 4: attention in one call per shelf
KEEP_ABOVE_SHARE = 0.85  # a profile measured with less of its threads' CPU time than this is not cached


def cpu_share(cpu_s: float, wall_s: float, threads: int) -> float:
    """The share of its threads' time a process was on a core: CPU seconds over threads x wall seconds
    (1.0 when nothing else wanted its cores; idle waits count against it, so measure compute only)."""
    if wall_s <= 0 or threads <= 0:
        return 1.0
    return cpu_s / (wall_s * threads)


def _prefilled(engine: TargetEngine, num_sequences: int, context_tokens: int) -> list:
    vocab = engine.target.vocab_size
    context_tokens = min(context_tokens, engine.target.max_context - 16)
    sequences = [engine.new_sequence() for _ in range(num_sequences)]
    for index, sequence in enumerate(sequences):  # distinct contents, so no row is a copy of another
        prompt = [(7 * position + 3 + 13 * index) % vocab for position in range(context_tokens)]
        engine.forward([ForwardRow(sequence, prompt, 1)])
    return sequences


def _time_step_once(engine: TargetEngine, sequences: list, num_tokens: int) -> float:
    """Ms of one step whose rows each feed num_tokens tokens and want logits for all of them; the rows are
    cropped back to their context afterwards, for the next timing."""
    vocab = engine.target.vocab_size
    base = sequences[0].length
    rows = [ForwardRow(sequence, [(11 * k + 5 + index) % vocab for k in range(num_tokens)], num_tokens)
            for index, sequence in enumerate(sequences)]
    started = time.perf_counter()
    engine.forward(rows)
    elapsed = 1000 * (time.perf_counter() - started)
    for sequence in sequences:
        sequence.crop(base)
    return elapsed


def measure_verify_profile(target: LoadedModel | TargetEngine, *, context_tokens: int = 64, repeats: int = 3,
                           sizes: tuple[int, ...] = VERIFY_SIZES, max_rows: int = 1,
                           step_sizes: tuple[int, ...] = STEP_SIZES,
                           step_rows: tuple[int, ...] = STEP_ROWS) -> dict[str, float]:
    """{"verify_ms_1": ..., "verify_ms_9": ...}: ms of one row of n tokens (the cost curve; it is
    not smooth on CPUs); with max_rows > 1 also {"step_ms_<rows>x<n>": ...} for step_rows up to max_rows.

    Each figure is the fastest of `repeats` timings, taken in passes over every cell (each cell once per pass)
    rather than a cell's repeats back to back: a worker measures while the rest of a stack starts, and on a
    shared VM the machine slows down for seconds at a time. A slow stretch then costs one pass a few cells,
    not a cell all its timings, and the profile, which is cached, keeps no stretch's figures for good."""
    engine = TorchEngine(target) if isinstance(target, LoadedModel) else target
    row_counts = [rows for rows in step_rows if 1 < rows <= max_rows]
    sequences = _prefilled(engine, max([1, *row_counts]), context_tokens)
    cells = {f"verify_ms_{n}": (1, n) for n in sizes}
    cells.update({f"step_ms_{rows}x{n}": (rows, n) for rows in row_counts for n in step_sizes})
    timings: dict[str, list[float]] = {name: [] for name in cells}
    try:
        for rows, n in cells.values():  # warm-up: every shape once (allocator, kernel choices)
            _time_step_once(engine, sequences[:rows], n)
        for _ in range(repeats):
            for name, (rows, n) in cells.items():
                timings[name].append(_time_step_once(engine, sequences[:rows], n))
    finally:
        for sequence in sequences:
            sequence.release()
    return {name: round(min(values), 3) for name, values in timings.items()}


def measure_verify_profiles(targets: dict[str, LoadedModel], *, context_tokens: int = 64,
                            rounds: int = 5) -> dict[str, dict[str, float]]:
    """measure_verify_profile for several models (e.g. weight layouts), taking turns round by round so a
    drift of this machine's speed hits them alike; per key, the median over rounds."""
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in targets}
    engines = {name: TorchEngine(target) for name, target in targets.items()}
    for _ in range(rounds):
        for name, engine in engines.items():
            samples[name].append(measure_verify_profile(engine, context_tokens=context_tokens, repeats=1))
    return {name: {key: round(statistics.median(sample[key] for sample in runs), 3) for key in runs[0]}
            for name, runs in samples.items()}


def step_table(profile: dict[str, float], rows: list[int], sizes: list[int]) -> str:
    """The grid as text: ms per step for rows x tokens per row, and plain decoding's tokens/s per row count."""
    lines = ["rows\t" + "\t".join(f"{n} tok ms" for n in sizes) + "\tplain tok/s"]
    for count in rows:
        cells = [profile.get(f"verify_ms_{n}" if count == 1 else f"step_ms_{count}x{n}") for n in sizes]
        single = profile.get("verify_ms_1" if count == 1 else f"step_ms_{count}x1")
        lines.append(f"{count}\t" + "\t".join("-" if c is None else f"{c:.2f}" for c in cells)
                     + (f"\t{1000 * count / single:.1f}" if single else "\t-"))
    return "\n".join(lines)


def _model_facts(model: LoadedModel) -> dict:
    # the architecture, not the folder it was loaded from (_name_or_path): the same model read from another cache
    # dir (MIRROR_SD_CACHE_DIR, a moved one) reads the profiles measured for it instead of measuring them again
    config = json.loads(model.config.to_json_string(use_diff=False))
    config.pop("_name_or_path", None)
    architecture = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]
    return {"model": model.name, "architecture": architecture, "precision": model.precision,
            "layout": model.layout, "device": str(model.device)}


def _key(facts: dict) -> str:
    return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def profile_cache_key(target: LoadedModel, max_rows: int) -> str:
    return _key({"format": PROFILE_FORMAT, **_model_facts(target), "threads": torch.get_num_threads(),
                 "torch": torch.__version__, "rows": [rows for rows in STEP_ROWS if rows <= max_rows],
                 "sizes": list(STEP_SIZES), "verify": list(VERIFY_SIZES)})


def read_cached(path: Path | None, what: str) -> dict[str, float] | None:
    """A profile stored at path; None when there is none (or it cannot be read: measured again)."""
    if path is not None and path.is_file():
        try:
            profile = json.loads(path.read_text())
            logger.info("%s profile from %s", what, path)
            return profile
        except ValueError:
            logger.warning("unreadable profile cache %s: measuring again", path)
    return None


def keep(path: Path, profile: dict[str, float]) -> None:
    """Store a profile at path, atomically: two workers starting at once never read half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_suffix(f".{os.getpid()}.tmp")
    temporary.write_text(json.dumps(profile))
    temporary.replace(path)


def _cached(path: Path | None, what: str, measure, threads: int) -> dict[str, float]:
    """The profile stored at path, or measure() (then stored there, unless this process, running `threads`
    threads, did not have its cores while it measured; path None: always measured)."""
    if (profile := read_cached(path, what)) is not None:
        return profile
    with measuring_turn(None if path is None else path.parent, what):
        if (profile := read_cached(path, what)) is not None:  # kept by the process whose turn came first
            return profile
        started, cpu_started = time.perf_counter(), time.process_time()
        profile = measure()
        wall_s = time.perf_counter() - started
        share = cpu_share(time.process_time() - cpu_started, wall_s, threads)
        logger.info("measured the %s profile in %.1f s (%.0f%% of %d threads' time on a core)", what, wall_s,
                    100 * share, threads)
        if share < KEEP_ABOVE_SHARE:
            logger.warning("the %s profile was measured while other processes took this one's cores (%.0f%% of "
                           "its threads' time on a core): used for this run, not cached; measured again next start",
                           what, 100 * share)
        elif path is not None:
            keep(path, profile)
    return profile


def cached_verify_profile(engine: TargetEngine, cache_dir: Path | None, *, max_rows: int) -> dict[str, float]:
    """The step grid for this engine, from cache_dir/profiles when measured before with the same facts."""
    path = None if cache_dir is None else (
        Path(cache_dir) / "profiles" / f"{profile_cache_key(engine.target, max_rows)}.json")
    return _cached(path, "device", lambda: measure_verify_profile(engine, max_rows=max_rows, repeats=3),
                   torch.get_num_threads())


DRAFT_BATCH_SESSIONS = (4, 16)  # sessions per batched draft step timed for the cost model (besides 1)


def measure_draft_profile(source: DraftSource, vocab_size: int, *, context_tokens: int = 64,
                          num_draft_tokens: int = 8, repeats: int = 3,
                          batch_sessions: tuple[int, ...] = DRAFT_BATCH_SESSIONS) -> dict[str, float]:
    """{"draft_ms_per_token": ..., "draft_step_ms_16": ...}: ms per proposed token of a fresh session's
    drafter (the fastest repeat, as for the verify profile); for a model draft that steps its sessions
    together, also ms of one batched draft step of that many sessions (what each of them waits per token)."""
    if source.references is not None:  # a synthetic draft: its cost is the one chosen (a sleep per token)
        return {"draft_ms_per_token": parse_synthetic_spec(source.spec).ms_per_token}
    drafter = source.new_drafter()
    if drafter is None:
        return {}
    # a hybrid's lookup costs about nothing; what a round pays when lookup finds nothing is the model half
    drafter = getattr(drafter, "model", drafter)
    prompt = [(7 * index + 3) % vocab_size for index in range(context_tokens)]
    context = [*prompt, *prompt[:16]]  # a repeat, so prompt lookup finds something to propose
    greedy = SamplingParams()
    timings = []
    try:
        for _ in range(repeats + 1):  # the first call warms up (and prefills a model draft's cache)
            started = time.perf_counter()
            proposal = drafter.propose(context, num_draft_tokens, greedy, None)
            timings.append(1000 * (time.perf_counter() - started) / max(1, proposal.num_draft_tokens))
    finally:
        drafter.release()
    profile = {"draft_ms_per_token": round(min(timings[1:]), 4)}
    engine = getattr(drafter, "draft_engine", None)
    if engine is not None:
        for sessions in batch_sessions:
            profile[f"draft_step_ms_{sessions}"] = _time_draft_batch(engine, sessions, context, vocab_size,
                                                                     num_draft_tokens, max(1, repeats - 1))
    return profile


def _time_draft_batch(engine, sessions: int, context: list[int], vocab_size: int, num_draft_tokens: int,
                      repeats: int) -> float:
    """Ms of one draft step of `sessions` sessions drafting together (their own contexts), fastest repeat."""
    drafters = [engine.new_drafter() for _ in range(sessions)]
    contexts = [[(token + 17 * index) % vocab_size for token in context] for index in range(sessions)]
    calls = [DraftCall(drafter, own, num_draft_tokens, SamplingParams(), None)
             for drafter, own in zip(drafters, contexts)]
    timings = []
    try:
        for _ in range(repeats + 1):  # the first prefills every session's KV
            started = time.perf_counter()
            proposals = propose_many(calls)
            steps = max(1, max(proposal.num_draft_tokens for proposal in proposals))
            timings.append(1000 * (time.perf_counter() - started) / steps)
    finally:
        for drafter in drafters:
            drafter.release()
    return round(min(timings[1:]), 4)


DRAFT_PROFILE_FORMAT = 1


def draft_profile_key(source: DraftSource, vocab_size: int) -> str:
    """Everything that changes what a draft costs here: the draft (its model, or its engine's own facts:
    a GGUF file, llama.cpp's threads and slots), the process's threads, the grid measured."""
    engine = getattr(source.engine, "engine", None)  # a torch draft engine's model is source.model
    engine_facts = engine.profile_facts() if hasattr(engine, "profile_facts") else None
    return _key({"format": DRAFT_PROFILE_FORMAT, "spec": source.spec, "hybrid": source.hybrid, "vocab": vocab_size,
                 "model": None if source.model is None else _model_facts(source.model), "engine": engine_facts,
                 "threads": torch.get_num_threads(), "torch": torch.__version__,
                 "sessions": list(DRAFT_BATCH_SESSIONS)})


def cached_draft_profile(source: DraftSource, vocab_size: int, cache_dir: Path | None) -> dict[str, float]:
    """measure_draft_profile, from cache_dir/profiles when measured before with the same facts (a model
    draft takes seconds: a draft worker its supervisor restarts takes work again that much sooner)."""
    path = None if cache_dir is None else (
        Path(cache_dir) / "profiles" / f"draft-{draft_profile_key(source, vocab_size)}.json")
    engine = getattr(source.engine, "engine", None)
    threads = getattr(engine, "threads", None) or torch.get_num_threads()  # a llama.cpp draft's own
    if source.references is not None:
        threads = 0  # a synthetic draft measures nothing: its cost is chosen
    return _cached(path, "draft", lambda: measure_draft_profile(source, vocab_size), threads)


def measure_cost_model(target: LoadedModel, source: DraftSource, cache_dir: Path | None = None) -> CostModel:
    """The in-process cost model (batch 1): this target's verify curve (cached in cache_dir when given) and
    this draft's per-token cost (a synthetic draft's: the one it was given). In one process a round drafts,
    then verifies: nothing overlaps (not pipelined)."""
    verify = cached_verify_profile(TorchEngine(target), cache_dir, max_rows=1)
    draft = cached_draft_profile(source, target.vocab_size, cache_dir).get("draft_ms_per_token", 0.0)
    return CostModel.from_profile(verify, draft, pipelined=False)


@contextmanager
def timed_kv_calls() -> Iterator[dict[str, float]]:
    """Seconds spent in the KV store's own work (growing buffers, writing new positions, taking views)
    while the block runs: the bookkeeping inside a forward."""
    spent = {"reserve": 0.0, "write": 0.0, "view": 0.0, "crop": 0.0}
    originals = {name: getattr(SequenceKV, name) for name in spent}

    def timed(name: str, method):
        def wrapper(*args, **kwargs):
            started = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started
        return wrapper

    for name, method in originals.items():
        setattr(SequenceKV, name, timed(name, method))
    try:
        yield spent
    finally:
        for name, method in originals.items():
            setattr(SequenceKV, name, method)


def measure_kv_share(engine: TargetEngine, *, rows: int = 16, num_tokens: int = 1, context_tokens: int = 256,
                     repeats: int = 5) -> dict[str, float]:
    """The share of a step's time spent in the KV store (reserve, write, view, crop), at `rows` rows of
    num_tokens over context_tokens each."""
    sequences = _prefilled(engine, rows, context_tokens)
    try:
        _time_step_once(engine, sequences, num_tokens)  # warm up untimed
        with timed_kv_calls() as spent:
            started = time.perf_counter()
            for _ in range(repeats):
                _time_step_once(engine, sequences, num_tokens)
            total = time.perf_counter() - started
    finally:
        for sequence in sequences:
            sequence.release()
    kv_s = sum(spent.values())
    return {"step_ms": round(1000 * total / repeats, 2), "kv_ms": round(1000 * kv_s / repeats, 3),
            "kv_share": round(kv_s / total, 4)}
