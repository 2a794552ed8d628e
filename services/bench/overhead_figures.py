"""The figures of `mirror-sd bench --overhead` (services/bench/overhead.py runs it): pure functions over what a
level measured, so they are tested without a stack.

- in process: single-stream target-only decoding in the bench's own process, the floor the stack is held to;
- per level and route: tokens/s, TPOT p50 against in process, TTFT p50, rows per step;
- per step: the verify worker's stage times (verify_worker/figures.py StageTimes) over the level, divided by
  its steps (ms per step) and by its rows (us per row);
- per token: CPU time of the gateway, the verify worker and the bench's own client, over the tokens streamed.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# the stages of a verify worker's turn, as its heartbeat's stage_times names them (verify_worker/figures.py
# StageTimes: "<stage>_s", besides turns and turn_s); a tooling package reads them by name, never imports the app
STAGES = ("intake", "wait", "draft", "plan", "prepare", "forward", "apply", "settle", "events", "commit")


@dataclass
class InProcess:
    """Target-only decoding of each prompt, one at a time, in the bench's process (services/engine/generate.py)."""

    num_prompts: int
    tokens: int
    decode_s: float  # summed over prompts: total - time to first token
    tpot_p50_ms: float | None  # per prompt (total - TTFT) / (tokens - 1), the median
    ttft_p50_ms: float | None
    tokens_per_s: float  # tokens / summed total time

    @property
    def ms_per_token(self) -> float | None:
        return self.tpot_p50_ms


def in_process(results: list) -> InProcess:
    """results: GenerationResult of each prompt (token_ids, ttft_s, total_s)."""
    tokens = sum(len(result.token_ids) for result in results)
    total_s = sum(result.total_s for result in results)
    tpots = [(result.total_s - result.ttft_s) / (len(result.token_ids) - 1) for result in results
             if len(result.token_ids) > 1]
    return InProcess(
        num_prompts=len(results), tokens=tokens, decode_s=round(sum(r.total_s - r.ttft_s for r in results), 4),
        tpot_p50_ms=round(1000 * statistics.median(tpots), 4) if tpots else None,
        ttft_p50_ms=round(1000 * statistics.median(r.ttft_s for r in results), 3) if results else None,
        tokens_per_s=round(tokens / total_s, 1) if total_s else 0.0)


def deltas(before: dict, after: dict) -> dict[str, float]:
    """after - before of cumulative counters (keys missing before count from 0)."""
    return {key: value - before.get(key, 0) for key, value in after.items() if isinstance(value, (int, float))}


@dataclass
class StepSplit:
    """A verify worker's turns over one level, from its StageTimes and StepCounters differences."""

    steps: int
    rows: int
    turns: int
    ms_per_step: dict[str, float] = field(default_factory=dict)  # stage -> ms per step; "turn", "other" too
    us_per_row: dict[str, float] = field(default_factory=dict)  # stage -> us per row of a step

    @property
    def rows_per_step(self) -> float | None:
        return round(self.rows / self.steps, 2) if self.steps else None

    @property
    def machinery_ms(self) -> float | None:
        """Per step: the turn's time less the forward and the waits (what the stack adds to the model)."""
        if not self.ms_per_step:
            return None
        return round(self.ms_per_step["turn"] - self.ms_per_step["forward"] - self.ms_per_step["wait"], 4)


def step_split(stages: dict[str, float], counters: dict[str, float]) -> StepSplit:
    """stages: StageTimes differences over a level (seconds); counters: StepCounters differences (steps, rows).
    other = turn - every stage: what the turn does besides them (cancellation checks, expiries, figures)."""
    steps, rows = int(counters.get("steps", 0)), int(counters.get("rows", 0))
    split = StepSplit(steps=steps, rows=rows, turns=int(stages.get("turns", 0)))
    if not steps:
        return split
    seconds = {stage: stages.get(f"{stage}_s", 0.0) for stage in STAGES}
    seconds["turn"] = stages.get("turn_s", 0.0)
    seconds["other"] = max(0.0, seconds["turn"] - sum(seconds[stage] for stage in STAGES))
    split.ms_per_step = {stage: round(1000 * value / steps, 4) for stage, value in seconds.items()}
    split.us_per_row = {stage: round(1e6 * value / rows, 2) for stage, value in seconds.items() if rows}
    return split


def cpu_us_per_token(cpu_s: float, tokens: int) -> float | None:
    """CPU seconds a process spent over a level (user + system) per token streamed, in microseconds."""
    return round(1e6 * cpu_s / tokens, 1) if tokens else None


def x_in_process(tpot_ms: float | None, baseline: InProcess) -> float | None:
    """A stream's time per token through the stack over the same in process (1.0: the stack adds nothing)."""
    if tpot_ms is None or not baseline.tpot_p50_ms:
        return None
    return round(tpot_ms / baseline.tpot_p50_ms, 2)


def top_functions(folded: list[str], limit: int = 25) -> tuple[int, list[tuple[str, float, float]]]:
    """A profile's folded stacks ("frame;frame;frame COUNT" per line, py-spy's raw format, root first): the
    samples, and the `limit` functions with the most samples of their own (self), each with its share of
    samples on the CPU in itself (self) and anywhere under it (total), largest self first."""
    own: dict[str, int] = {}
    under: dict[str, int] = {}
    samples = 0
    for line in folded:
        stack, _, count_text = line.rstrip().rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        samples += count
        own[frames[-1]] = own.get(frames[-1], 0) + count
        for frame in set(frames):
            under[frame] = under.get(frame, 0) + count
    if not samples:
        return 0, []
    ranked = sorted(own, key=lambda frame: (-own[frame], frame))[:limit]
    return samples, [(frame, round(own[frame] / samples, 4), round(under[frame] / samples, 4)) for frame in ranked]


def top_text(title: str, folded: list[str], limit: int = 25) -> str:
    """top_functions as a text table (what the report links beside the folded stacks)."""
    samples, rows = top_functions(folded, limit)
    lines = [f"{title}: {samples} samples on the CPU", f"{'self':>7} {'total':>7}  function (file:line)"]
    lines += [f"{own:7.1%} {total:7.1%}  {frame}" for frame, own, total in rows]
    return "\n".join(lines) + "\n"
