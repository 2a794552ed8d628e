"""Run prompts through one mode and collect per-prompt results; greedy checks against `ar`."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tqdm import tqdm

from services.bench.prompts import BenchPrompt
from services.engine import GenerationOptions, GenerationResult

logger = logging.getLogger(__name__)

GenerateOne = Callable[[Sequence[int], GenerationOptions], GenerationResult]


@dataclass
class PromptRun:
    mode: str  # "ar", "sd:<draft>", "hf-assisted:<draft>", "hf-lookup:<n>", "stack"
    prompt: BenchPrompt
    result: GenerationResult
    matches_ar: bool | None = None  # greedy equality with the ar run; None when not checked
    rouge_l: float | None = None  # ROUGE-L F1 of the text against the ar run's


def run_mode(
    mode: str,
    generate_one: GenerateOne,
    prompts: list[BenchPrompt],
    encoded: list[list[int]],
    options: GenerationOptions,
    *,
    repeat: int = 1,
    warmup: int = 1,
    progress: bool = True,
) -> list[PromptRun]:
    for prompt_ids in encoded[:warmup]:
        generate_one(prompt_ids, replace(options, max_new_tokens=8))
    runs: list[PromptRun] = []
    for prompt, prompt_ids in tqdm(list(zip(prompts, encoded)), desc=mode, disable=not progress, leave=False):
        for _ in range(repeat):
            runs.append(PromptRun(mode, prompt, generate_one(prompt_ids, options)))
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
            run.rouge_l = scorer.score(reference[run.prompt.id], run.result.text)["rougeL"].fmeasure
