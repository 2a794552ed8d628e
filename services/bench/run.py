"""A whole bench run: modes over one prompt set, greedy checks, report files."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from services.bench.prompts import BenchPrompt
from services.bench.report import build_report, to_json, to_markdown
from services.bench.runner import PromptRun, check_against_ar, run_mode
from services.config import Settings
from services.engine import GenerationOptions
from services.models.drafters import load_draft_source
from services.models.loading import LoadedModel
from services.speculative.sampling import SamplingParams

logger = logging.getLogger(__name__)


def parse_modes(text: str) -> list[str]:
    modes = [mode.strip() for mode in text.split(",") if mode.strip()]
    for mode in modes:
        if mode not in ("ar", "stack") and not mode.startswith("sd:"):
            raise ValueError(f"unknown mode {mode!r}: use ar, sd:<draft> or stack")
    if not modes:
        raise ValueError("no modes given")
    return modes


@dataclass
class BenchConfig:
    modes: list[str]
    prompts: list[BenchPrompt]
    sampling: SamplingParams
    max_new_tokens: int
    repeat: int = 1
    warmup: int = 1
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    meta: dict = field(default_factory=dict)


@dataclass
class BenchOutcome:
    table: str
    mismatches: dict[str, list[str]]


def _run_stack(config: BenchConfig, settings: Settings) -> tuple[list[PromptRun], dict]:
    from services.bench.stack_client import percentile, run_stack, transport_samples
    from services.protocol import TRANSPORT_SAMPLES_MAX

    before = len(transport_samples(settings.redis_url))
    options = GenerationOptions(sampling=config.sampling, max_new_tokens=config.max_new_tokens)
    runs = run_stack(config.url, config.api_key, settings.target, config.prompts, options,
                     repeat=config.repeat, warmup=config.warmup)
    samples = transport_samples(settings.redis_url)
    fresh = samples[: max(0, len(samples) - before)] if before < TRANSPORT_SAMPLES_MAX else samples
    return runs, {"rounds": len(fresh), "p50_ms": percentile(fresh, 0.5), "p99_ms": percentile(fresh, 0.99)}


def run_bench(config: BenchConfig, settings: Settings, target: LoadedModel, out_dir: Path) -> BenchOutcome:
    runs_by_mode: dict[str, list[PromptRun]] = {}
    transport: dict = {}
    for mode in config.modes:
        if mode == "stack":
            runs_by_mode[mode], transport = _run_stack(config, settings)
            continue
        source = load_draft_source("none" if mode == "ar" else mode.split(":", 1)[1], target,
                                   speculative=settings.speculative)
        options = GenerationOptions(sampling=config.sampling, max_new_tokens=config.max_new_tokens,
                                    speculative=settings.speculative, chunk_size=settings.prefill_chunk_size)
        runs_by_mode[mode] = run_mode(mode, target, source, config.prompts, options, repeat=config.repeat,
                                      warmup=config.warmup)
    mismatches = {}
    if config.sampling.greedy and "ar" in runs_by_mode:
        mismatches = {mode: check_against_ar(runs, runs_by_mode["ar"])
                      for mode, runs in runs_by_mode.items() if mode != "ar"}
    rows = build_report(runs_by_mode)
    meta = {**config.meta, "modes": config.modes, "num_prompts": len(config.prompts), "target": target.name,
            "max_new_tokens": config.max_new_tokens, "temperature": config.sampling.temperature}
    if transport:
        meta["transport_overhead"] = transport
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(to_json(rows, runs_by_mode, meta), indent=1))
    ordered = sorted(rows, key=lambda row: row.scope.startswith("category:"))
    table = to_markdown(ordered)
    if transport:
        table += (f"\nstack transport overhead per round (round trip minus verify time): p50 "
                  f"{transport['p50_ms']:.3f} ms, p99 {transport['p99_ms']:.3f} ms over {transport['rounds']} rounds\n")
    (out_dir / "results.md").write_text(table)
    return BenchOutcome(table, {mode: ids for mode, ids in mismatches.items() if ids})
