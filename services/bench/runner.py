"""Run prompts through one mode and collect per-prompt results; greedy checks against `ar`, format checks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from tqdm import tqdm

from services.bench.formats import check_output
from services.bench.journal import Journal
from services.bench.prompts import BenchPrompt, Turn, next_messages
from services.engine import GenerationOptions, GenerationResult

logger = logging.getLogger(__name__)


@dataclass
class PromptRun:
    mode: str  # "ar", "sd:<draft>", "hf-assisted:<draft>", "hf-lookup:<n>", "stack"
    prompt: BenchPrompt
    result: GenerationResult
    matches_ar: bool | None = None  # greedy equality with the ar run; None when not checked
    rouge_l: float | None = None  # ROUGE-L F1 of the text against the ar run's
    turn: int = 1  # which user turn of the prompt this run answered (1 = the first)
    prompt_ids: list[int] = field(default_factory=list)  # the turn's input, as this mode's own chat made it
    # for a prompt with a schema: whether the answer is JSON, and valid against the schema (None: no schema)
    parses_as_json: bool | None = None
    matches_schema: bool | None = None

    @property
    def id(self) -> str:
        return self.prompt.turn_id(self.turn)

    @property
    def group(self) -> str:
        return self.prompt.turn_group(self.turn)


RunPrompt = Callable[[Turn, GenerationOptions], GenerationResult]  # one mode: a turn -> its result
Encode = Callable[[list[dict]], list[int]]  # chat messages -> the target's prompt ids


def run_interleaved(
    modes: dict[str, RunPrompt],
    prompts: list[BenchPrompt],
    encode: Encode,
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
    hits all modes alike. A conversation goes turn by turn, every mode on turn 1, then every mode on turn 2, each
    mode's chat carrying its own earlier answers (its first run's, with --repeat). Runs the journal already holds
    are reused, not rerun; after(run) sees each run.
    journalled_only: run nothing, keep the turns the journal holds in every mode (an interrupted run's report);
    a conversation stops at its first turn that some mode lacks."""
    runs: dict[str, list[PromptRun]] = {mode: [] for mode in modes}
    warm: set[str] = set()
    for prompt in tqdm(prompts, desc="prompts", disable=not progress, leave=False):
        messages = {mode: [{"role": "user", "content": prompt.prompt}] for mode in modes}
        answers: dict[str, str] = {}  # each mode's answer to the turn before
        for turn in range(1, len(prompt.turns) + 1):
            if turn > 1:
                messages = {mode: next_messages(messages[mode], answers[mode], prompt.turns[turn - 1])
                            for mode in modes}
            inputs = {mode: Turn(prompt.turn_id(turn), chat, encode(chat), prompt.schema)
                      for mode, chat in messages.items()}
            done = {mode: journal.done(mode, turn_input.id, turn_input.prompt_ids, turn_input.schema)[:repeat]
                    if journal else [] for mode, turn_input in inputs.items()}
            if journalled_only and any(len(results) < repeat for results in done.values()):
                break  # the later turns' chats need this turn's answers
            for mode, run_prompt in modes.items():
                turn_input, results = inputs[mode], done[mode]
                if len(results) < repeat and mode not in warm:  # warm-up runs (8 tokens) before a mode's first run
                    warm.add(mode)
                    for _ in range(warmup):
                        run_prompt(turn_input, replace(options, max_new_tokens=8))
                for _ in range(repeat - len(results)):
                    result = run_prompt(turn_input, options)
                    if journal is not None:
                        journal.record(mode, turn_input.id, turn_input.prompt_ids, result, turn_input.schema)
                    results.append(result)
                answers[mode] = results[0].text
                for result in results:
                    runs[mode].append(PromptRun(mode, prompt, result, turn=turn, prompt_ids=turn_input.prompt_ids))
                    if after is not None:
                        after(runs[mode][-1])
    return runs


def check_against_ar(runs: list[PromptRun], ar_runs: list[PromptRun]) -> list[str]:
    """Mark each run's greedy equality with ar; return the ids that differ."""
    reference = {run.id: run.result.token_ids for run in ar_runs}
    mismatched = []
    for run in runs:  # turn by turn: a later turn's input is the mode's own chat, so it is checked too
        run.matches_ar = run.result.token_ids == reference.get(run.id)
        if not run.matches_ar:
            mismatched.append(run.id)
    return mismatched


def score_rouge_l(runs: list[PromptRun], ar_runs: list[PromptRun]) -> None:
    """ROUGE-L F1 of each run's text against ar's (1.0 when greedy runs agree; meaningful when sampling)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rougeL"])
    reference = {run.id: run.result.text for run in ar_runs}
    for run in runs:
        if run.id in reference:
            same = run.result.text == reference[run.id]  # rouge-score drops non-ASCII words: "" vs "" is 0
            run.rouge_l = 1.0 if same else scorer.score(reference[run.id], run.result.text)["rougeL"].fmeasure


def check_formats(runs: list[PromptRun]) -> None:
    """Mark each run of a prompt with a schema: does its answer parse as JSON, and match the schema."""
    for run in runs:
        if run.prompt.schema is not None:
            run.parses_as_json, run.matches_schema = check_output(run.result.text, run.prompt.schema)
