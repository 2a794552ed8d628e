"""Run prompts through one mode and collect per-prompt results; greedy checks against `ar`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from tqdm import tqdm

from services.bench.journal import Journal
from services.bench.prompts import BenchPrompt
from services.engine import GenerationOptions, GenerationResult

logger = logging.getLogger(__name__)


@dataclass
class PromptRun:
    mode: str  # "ar", "sd:<draft>", "hf-assisted:<draft>", "hf-lookup:<n>", "stack"
    prompt: BenchPrompt
    result: GenerationResult
    matches_ar: bool | None = None  # greedy equality with the ar run; None when not checked
    rouge_l: float | None = None  # ROUGE-L F1 of the text against the ar run's


RunPrompt = Callable[[BenchPrompt, list[int], GenerationOptions], GenerationResult]  # one mode: a prompt -> result


def run_interleaved(
    modes: dict[str, RunPrompt],
    prompts: list[BenchPrompt],
    encoded: dict[str, list[int]],
    options: GenerationOptions,
    *,
    repeat: int = 1,
    warmup: int = 1,
    progress: bool = True,
    journal: Journal | None = None,
    after: Callable[[PromptRun], None] | None = None,
    journalled_only: bool = False,
) -> dict[str, list[PromptRun]]:
    """Every mode on prompt 1, then every mode on prompt 2, ...: a slow drift of the machine's speed
    hits all modes alike. Runs the journal already holds are reused, not rerun; after(run) sees each run.
    journalled_only: run nothing, keep the prompts the journal holds in every mode (an interrupted run's report)."""
    def done(mode: str, prompt: BenchPrompt) -> list[GenerationResult]:
        return journal.done(mode, prompt.id, encoded[prompt.id])[:repeat] if journal else []

    if journalled_only:
        prompts = [prompt for prompt in prompts if all(len(done(mode, prompt)) == repeat for mode in modes)]

    runs: dict[str, list[PromptRun]] = {mode: [] for mode in modes}
    warm: set[str] = set()
    for prompt in tqdm(prompts, desc="prompts", disable=not progress, leave=False):
        for mode, run_prompt in modes.items():
            results = done(mode, prompt)
            if len(results) < repeat and mode not in warm:  # warm-up runs (8 tokens) before a mode's first run
                warm.add(mode)
                for _ in range(warmup):
                    run_prompt(prompt, encoded[prompt.id], replace(options, max_new_tokens=8))
            for _ in range(repeat - len(results)):
                result = run_prompt(prompt, encoded[prompt.id], options)
                if journal is not None:
                    journal.record(mode, prompt.id, encoded[prompt.id], result)
                results.append(result)
            for result in results:
                runs[mode].append(PromptRun(mode, prompt, result))
                if after is not None:
                    after(runs[mode][-1])
    return runs


def check_against_ar(runs: list[PromptRun], ar_runs: list[PromptRun]) -> list[str]:
    """Mark each run's greedy equality with ar; return the ids that differ."""
    reference = {run.prompt.id: run.result.token_ids for run in ar_runs}
    mismatched = []
    for run in runs:
        run.matches_ar = run.result.token_ids == reference.get(run.prompt.id)
        if not run.matches_ar:
            mismatched.append(run.prompt.id)
    return mismatched


def score_rouge_l(runs: list[PromptRun], ar_runs: list[PromptRun]) -> None:
    """ROUGE-L F1 of each run's text against ar's (1.0 when greedy runs agree; meaningful when sampling)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    reference = {run.prompt.id: run.result.text for run in ar_runs}
    for run in runs:
        if run.prompt.id in reference:
            same = run.result.text == reference[run.prompt.id]  # rouge-score drops non-ASCII words: "" vs "" is 0
            run.rouge_l = 1.0 if same else scorer.score(reference[run.prompt.id], run.result.text)["rougeL"].fmeasure
