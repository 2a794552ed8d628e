"""Run prompts through `ar` and `sd` modes in-process and collect per-prompt results."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from tqdm import tqdm

from services.bench.prompts import BenchPrompt
from services.engine import GenerationOptions, GenerationResult, generate
from services.models.drafters import DraftSource
from services.models.loading import LoadedModel
from services.models.tokenization import encode_prompt

logger = logging.getLogger(__name__)


@dataclass
class PromptRun:
    mode: str  # "ar" or "sd:<draft>"
    prompt: BenchPrompt
    result: GenerationResult
    matches_ar: bool | None = None  # greedy equality with the ar run; None when not checked


def run_mode(
    mode: str,
    target: LoadedModel,
    draft_source: DraftSource,
    prompts: list[BenchPrompt],
    options: GenerationOptions,
    *,
    chat: bool = True,
    repeat: int = 1,
    warmup: int = 1,
    progress: bool = True,
) -> list[PromptRun]:
    encoded = [encode_prompt(target.tokenizer, p.prompt, chat=chat) for p in prompts]
    for prompt_ids in encoded[:warmup]:
        generate(target, draft_source, prompt_ids, replace(options, max_new_tokens=8))
    runs: list[PromptRun] = []
    for prompt, prompt_ids in tqdm(list(zip(prompts, encoded)), desc=mode, disable=not progress, leave=False):
        for _ in range(repeat):
            result = generate(target, draft_source, prompt_ids, options)
            runs.append(PromptRun(mode, prompt, result))
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
