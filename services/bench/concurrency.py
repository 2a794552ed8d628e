"""`mirror-sd bench --concurrency 1,4,8,16,32`: throughput and latency under load, the stack against plain
batched decoding: the closed loop and its figures (the report: services/bench/concurrency_report.py).

Modes, at every concurrency level C (N requests, C in flight, closed loop):
- `stack`: the running stack, speculative route (what the routing table picks);
- `stack-ar`: the same stack, plain target decoding (`"route": "ar"`, same batched step, no draft);
- `baseline`: the `stack` mode against another gateway (`--baseline-url`, e.g. an older build);
- `hf-batch`: transformers' `generate` over left-padded static batches of C prompts, in this process.
Modes take turns level by level, so a drift of the machine's speed hits all alike; with --repeat, in
alternating order (A B, B A, ...), and the report gives each turn's figure and stack / stack-ar turn by turn.
Before a level's timed runs, every stack mode runs it untimed (`warmup` passes of C requests at C in flight, 8
tokens each): whatever a worker pays the first time it holds C sessions (its KV grown for them, new step shapes,
its measured turns at that load) would otherwise land on whichever mode comes first. Every greedy output of the
stack modes is checked against single-stream target-only decoding in this process: a mismatch is
reported with the prompt, the position and the target's top-2 logit gap there, and fails the run when the
gap is above 1e-3 (fp32 batched matmuls may differ from batch 1 in the last bits, nothing more).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from services.bench.concurrency_report import plot_concurrency, write_json, write_markdown
from services.bench.hf_batch import run_hf_batch_level
from services.bench.load import LevelRun, run_level
from services.bench.prompts import BenchPrompt
from services.engine import GenerationOptions, generate
from services.models.drafters import DraftSource
from services.models.loading import LoadedModel
from services.models.tokenization import encode_prompt
from services.synthetic import describe_label
from services.speculative.stats import percentile

logger = logging.getLogger(__name__)

CONCURRENCY_MODES = ("stack", "stack-ar", "baseline", "hf-batch")
MISMATCH_GAP = 1e-3
WARMUP_TOKENS = 8


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: use a comma list of integers, e.g. 1,4,8,16") from None
    if not levels or any(level < 1 for level in levels):
        raise ValueError(f"--concurrency {text!r}: every level must be >= 1")
    return sorted(set(levels))


def parse_concurrency_modes(text: str, baseline_url: str | None) -> list[str]:
    modes = list(dict.fromkeys(mode.strip() for mode in text.split(",") if mode.strip()))
    for mode in modes:
        if mode not in CONCURRENCY_MODES:
            raise ValueError(f"unknown concurrency mode {mode!r}: use {', '.join(CONCURRENCY_MODES)}")
    if "baseline" in modes and not baseline_url:
        raise ValueError("the baseline mode needs --baseline-url (the other gateway)")
    if not modes:
        raise ValueError("no modes given")
    return modes


@dataclass
class ConcurrencyConfig:
    levels: list[int]
    modes: list[str]
    prompts: list[BenchPrompt]
    max_tokens: int
    url: str
    model: str
    baseline_url: str | None = None
    api_key: str | None = None
    redis_url: str | None = None
    chat: bool = True
    requests: int | None = None  # per level; default max(len(prompts), C)
    repeat: int = 1  # every (level, mode) this many times, taking turns; figures over all of them
    warmup: int = 1  # untimed passes of each level by every stack mode before its timed runs


@dataclass
class LevelRow:
    mode: str
    concurrency: int
    requests: int
    tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    tpot_p50_ms: float | None
    e2e_p50_s: float | None
    acceptance_rate: float | None
    mismatches: int
    extra: dict = field(default_factory=dict)


@dataclass
class Mismatch:
    mode: str
    concurrency: int
    prompt_id: str
    position: int
    top2_gap: float

    @property
    def fatal(self) -> bool:
        return self.top2_gap > MISMATCH_GAP


def _ms(value: float | None) -> float | None:
    return None if value is None else round(1000 * value, 2)


def summarize(run: LevelRun, mismatches: int) -> LevelRow:
    records = run.records
    tokens = sum(record.num_tokens for record in records)
    gaps = [gap for record in records for gap in record.chunk_gaps_s]
    drafted = sum(record.stats.get("num_draft_tokens", 0) for record in records)
    accepted = sum(record.stats.get("num_accepted_tokens", 0) for record in records)
    return LevelRow(
        mode=run.mode, concurrency=run.concurrency, requests=len(records), tokens=tokens, wall_s=round(run.wall_s, 3),
        tokens_per_s=round(tokens / run.wall_s, 2) if run.wall_s else 0.0,
        ttft_p50_ms=_ms(percentile([r.ttft_s for r in records if r.ttft_s is not None], 0.5)),
        ttft_p99_ms=_ms(percentile([r.ttft_s for r in records if r.ttft_s is not None], 0.99)),
        itl_p50_ms=_ms(percentile(gaps, 0.5)), itl_p99_ms=_ms(percentile(gaps, 0.99)),
        tpot_p50_ms=_ms(percentile([r.tpot_s for r in records if r.tpot_s is not None], 0.5)),
        e2e_p50_s=percentile([r.e2e_s for r in records], 0.5),
        acceptance_rate=round(accepted / drafted, 3) if drafted else None,
        mismatches=mismatches, extra=run.extra,
    )


def top2_gap(target: LoadedModel, context_ids: list[int]) -> float:
    """The target's top-1 minus top-2 logit after context_ids (how close to a tie the token was)."""
    with torch.inference_mode():
        logits = target.model(torch.tensor([context_ids], device=target.device)).logits[0, -1].float()
    best = torch.topk(logits, 2).values
    return float(best[0] - best[1])


def check_greedy(run: LevelRun, reference: dict[str, list[int]], encoded: dict[str, list[int]],
                 target: LoadedModel) -> list[Mismatch]:
    found = []
    for record in run.records:
        expected = reference[record.prompt_id]
        if record.token_ids == expected:
            continue
        position = next((i for i, (a, b) in enumerate(zip(record.token_ids, expected)) if a != b),
                        min(len(record.token_ids), len(expected)))
        gap = top2_gap(target, [*encoded[record.prompt_id], *expected[:position]])
        found.append(Mismatch(run.mode, run.concurrency, record.prompt_id, position, round(gap, 6)))
    return found


def _verify_counters(redis_url: str | None, *, sent_after: float = 0.0, wait_s: float = 5.0) -> dict[str, dict]:
    """Cumulative step counters of every live verify worker, from heartbeats sent after `sent_after` (wall
    clock): a heartbeat is up to an interval old, so reading right after a short level would miss it."""
    if not redis_url:
        return {}
    from services.redis_client import read_heartbeats
    from services.redis_conn import connect

    client = connect(redis_url)
    deadline = time.monotonic() + wait_s
    while True:
        beats = [beat for beat in read_heartbeats(client) if beat.role == "verify" and beat.step_counters]
        if all(beat.sent_at > sent_after for beat in beats) or time.monotonic() > deadline:
            return {beat.worker_id: dict(beat.step_counters) for beat in beats}
        time.sleep(0.1)


def step_figures(before: dict[str, dict], after: dict[str, dict]) -> dict:
    """Mean rows per step and the share of step time outside the model's forward (bookkeeping: building
    rows, the round math, commits) over a level, from the verify workers' counters."""
    totals = {"steps": 0.0, "rows": 0.0, "forward_s": 0.0, "step_s": 0.0}
    for worker, counters in after.items():
        earlier = before.get(worker, {})
        for key in totals:
            totals[key] += counters.get(key, 0.0) - earlier.get(key, 0.0)
    if not totals["steps"] or not totals["step_s"]:
        return {}
    return {"mean_rows_per_step": round(totals["rows"] / totals["steps"], 2),
            "step_ms": round(1000 * totals["step_s"] / totals["steps"], 2),
            "bookkeeping_share": round(1 - totals["forward_s"] / totals["step_s"], 4)}


def reference_outputs(target: LoadedModel, prompts: list[BenchPrompt], encoded: dict[str, list[int]],
                      max_tokens: int) -> dict[str, list[int]]:
    """Single-stream target-only greedy decoding in this process: what every stack output must equal."""
    options = GenerationOptions(max_new_tokens=max_tokens)
    unique = {prompt.id: prompt for prompt in prompts}
    return {pid: generate(target, DraftSource("none"), encoded[pid], options).token_ids for pid in unique}


def level_prompts(prompts: list[BenchPrompt], concurrency: int, requests: int | None) -> list[BenchPrompt]:
    count = requests or max(len(prompts), concurrency)
    return [prompts[index % len(prompts)] for index in range(count)]


def served(config: ConcurrencyConfig) -> tuple[str, dict | None]:
    """The model the stack the stack modes load serves, and its synthetic label (its /v1/models: the settings'
    target and None when it does not answer, or when no stack mode runs)."""
    if not {"stack", "stack-ar"} & set(config.modes):
        return config.model, None
    import httpx

    from services.bench.stack_client import served_model

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    with httpx.Client(base_url=config.url, headers=headers, timeout=10) as client:
        return served_model(client, config.model)


def publish_references(config: ConcurrencyConfig, label: dict | None, reference: dict[str, list[int]],
                       encoded: dict[str, list[int]]) -> bool:
    """A stack whose draft is synthetic drafts from the target's greedy output (services/synthetic.py): each
    prompt's, published to the stack's Redis before any level runs. False (nothing written) for another stack."""
    if not label or "draft" not in label:
        return False
    from services.redis_conn import connect
    from services.synthetic import publish_reference

    client = connect(config.redis_url)
    for prompt_id, output_ids in reference.items():
        publish_reference(client, encoded[prompt_id], output_ids)
    return True


def run_concurrency_bench(config: ConcurrencyConfig, target: LoadedModel, out_dir: Path,
                          progress=print) -> tuple[list[LevelRow], list[Mismatch], list[Path]]:
    encoded = {p.id: encode_prompt(target.tokenizer, p.prompt, chat=config.chat) for p in config.prompts}
    progress(f"reference: single-stream target-only decoding of {len(encoded)} prompts in this process")
    reference = reference_outputs(target, config.prompts, encoded, config.max_tokens)
    model, label = served(config)
    config = replace(config, model=model)
    if label:
        progress(f"stack: {describe_label(label)}")
    if publish_references(config, label, reference, encoded):
        progress(f"published {len(reference)} greedy references for the stack's synthetic draft")
    urls = {"stack": config.url, "stack-ar": config.url, "baseline": config.baseline_url}
    rows: list[LevelRow] = []
    mismatches: list[Mismatch] = []
    for concurrency in config.levels:
        batch = level_prompts(config.prompts, concurrency, config.requests)
        warm_level(config, urls, batch[:concurrency], concurrency)
        runs: dict[str, list[LevelRun]] = {mode: [] for mode in config.modes}
        for turn in range(config.repeat):
            for mode in turn_order(config.modes, turn):
                run, found = _run_mode(mode, config, urls, target, batch, concurrency, reference, encoded)
                runs[mode].append(run)
                mismatches += found
        for mode in config.modes:
            run = merge_runs(runs[mode])
            row = summarize(run, sum(1 for m in mismatches if m.mode == mode and m.concurrency == concurrency))
            rows.append(row)
            progress(f"C={concurrency:<3} {mode:9} {row.tokens_per_s:7.1f} tok/s  TTFT p50 {row.ttft_p50_ms} ms  "
                     f"ITL p50/p99 {row.itl_p50_ms}/{row.itl_p99_ms} ms  {row.extra}")
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [write_json(out_dir / "concurrency.json", config, rows, mismatches, label),
             write_markdown(out_dir / "concurrency.md", rows, mismatches, label, warmup=config.warmup,
                            warmup_tokens=WARMUP_TOKENS)]
    plot = plot_concurrency(rows, out_dir / "throughput_vs_concurrency.png")
    return rows, mismatches, files + ([plot] if plot else [])


def warm_level(config: ConcurrencyConfig, urls: dict, batch: list[BenchPrompt], concurrency: int) -> None:
    """`config.warmup` untimed passes of a level by every stack mode (8 tokens a request, nothing checked)."""
    for _ in range(config.warmup):
        for mode in config.modes:
            if mode in urls:
                run_level(urls[mode], config.model, batch, concurrency, max_tokens=WARMUP_TOKENS,
                          api_key=config.api_key, route="ar" if mode == "stack-ar" else None)


def turn_order(modes: list[str], turn: int) -> list[str]:
    """The modes' order in a level's turn `turn` (0 first): as given, then reversed, and so on (A B, B A, A B ...),
    so that what the first run after a level's warm-up pays (one mode's sessions growing the worker's memory for C
    sessions first, the machine's drift within a turn) does not always fall on the same mode."""
    return list(modes) if turn % 2 == 0 else list(reversed(modes))


def merge_runs(runs: list[LevelRun]) -> LevelRun:
    """Repeats of one (mode, level) as one: all records, summed wall time, per-run figures averaged."""
    extra: dict = {}
    for key in {key for run in runs for key in run.extra}:
        values = [run.extra[key] for run in runs if key in run.extra]
        counts = all(isinstance(value, int) for value in values)  # counts add up, rates average
        extra[key] = sum(values) if counts else round(sum(values) / len(values), 4)
    if len(runs) > 1:
        extra["tokens_per_s_runs"] = [round(sum(r.num_tokens for r in run.records) / run.wall_s, 1) for run in runs]
    return LevelRun(runs[0].mode, runs[0].concurrency, [record for run in runs for record in run.records],
                    sum(run.wall_s for run in runs), extra)


def _run_mode(mode: str, config: ConcurrencyConfig, urls: dict, target: LoadedModel, batch: list[BenchPrompt],
              concurrency: int, reference: dict, encoded: dict) -> tuple[LevelRun, list[Mismatch]]:
    if mode == "hf-batch":
        run = run_hf_batch_level(target, batch, [encoded[p.id] for p in batch], concurrency,
                                 max_tokens=config.max_tokens)
        notes = check_greedy(run, reference, encoded, target)
        run.extra["greedy_mismatches_noted"] = len(notes)  # transformers' padding: not ours to fail on
        return run, []
    counters = _verify_counters(config.redis_url, sent_after=time.time()) if mode != "baseline" else {}
    run = run_level(urls[mode], config.model, batch, concurrency, max_tokens=config.max_tokens,
                    api_key=config.api_key, route="ar" if mode == "stack-ar" else None, mode=mode)
    if mode != "baseline":
        run.extra.update(step_figures(counters, _verify_counters(config.redis_url, sent_after=time.time())))
    return run, check_greedy(run, reference, encoded, target)
