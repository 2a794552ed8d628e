"""What a verify worker counts, collected here and exported in its heartbeat (and from there to telemetry,
/metrics and the bench): step counters, recent acceptance, per-token latency."""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import asdict, dataclass, field

logger = logging.getLogger(__name__)


@dataclass
class StepCounters:
    """Cumulative, so a reader takes differences over any interval (the bench does, per level)."""

    steps: int = 0
    rows: int = 0
    tokens: int = 0
    forward_s: float = 0.0  # in the engine's forward
    step_s: float = 0.0  # forward + preparing rows, the round math, commits
    bridged_rounds: int = 0  # target-only rounds run while a block was on its way (bridging), counted per block
    blocks_bridged: int = 0  # blocks that came after such rounds
    blocks_answered: int = 0  # of those, blocks with nothing left to verify (answered at once)
    wide_steps: int = 0  # steps run on worker.wide_threads (no draft worker drafting for any session)

    @property
    def mean_rows(self) -> float:
        """rows / steps."""
        return self.rows / self.steps if self.steps else 0.0


@dataclass
class StageTimes:
    """Where a verify worker's turns spend their time, summed per stage (seconds, cumulative, like StepCounters;
    `mirror-sd bench --overhead` reads differences per level). Each stage is a perf_counter delta taken around
    code the loop runs anyway: a few timer reads a turn, nothing per token.

    intake: popping blocks from Redis (the non-blocking pops), decoding them, admitting them (a new session reads
      its request from Redis); wait: blocked on an empty queue, and the batch window for blocks on their way;
    draft: co-located drafting (placement local); plan: choosing the step's rows, the KV budget, the threads;
    prepare / forward / apply: building the rows, the engine's forward, the round math (services/engine/target.py
    StepSplit); settle: reading the replies of the last step's commits (written before this forward) and acting on
    them; events: the output events and verdicts built from the results; commit: writing them (one commit script
    each, replies read at the next settle); turn: every turn's whole time, so other = turn - the stages above
    (cancellation checks, expiries, figures)."""

    turns: int = 0
    turn_s: float = 0.0
    intake_s: float = 0.0
    wait_s: float = 0.0
    draft_s: float = 0.0
    plan_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    apply_s: float = 0.0
    settle_s: float = 0.0
    events_s: float = 0.0
    commit_s: float = 0.0

    def since(self, stage: str, started: float) -> float:
        """Adds the time since `started` (a perf_counter reading) to `stage`; returns now, the next stage's start."""
        now = time.perf_counter()
        self.__dict__[f"{stage}_s"] += now - started
        return now


@dataclass
class WorkerFigures:
    counters: StepCounters = field(default_factory=StepCounters)
    stages: StageTimes = field(default_factory=StageTimes)
    rounds: deque = field(default_factory=lambda: deque(maxlen=200))  # (drafted, accepted) of recent rounds
    token_ms: deque = field(default_factory=lambda: deque(maxlen=200))  # step ms per committed token, recent
    # the same, of steps another session shared (two rows or more): what load does to a stream. A lone stream's
    # slow step is its own block's length, a rejection early in it, a pause of the box: no sign of load, and
    # shorter blocks (what a degraded pool gets) would only slow it (telemetry/rules.py)
    shared_token_ms: deque = field(default_factory=lambda: deque(maxlen=200))

    def record_round(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.rounds.append((num_draft_tokens, num_accepted))

    def record_bridged(self, num_rounds: int, *, answered: bool) -> None:
        """A block came `num_rounds` bridged rounds after its point; answered: nothing of it was left to verify."""
        self.counters.bridged_rounds += num_rounds
        self.counters.blocks_bridged += 1
        self.counters.blocks_answered += int(answered)

    def record_step(self, *, rows: int, tokens: int, forward_s: float, step_s: float, streaming_rows: int,
                    streamed: int, wide: bool = False) -> None:
        """streaming_rows: rows of running streams (their prompt done); streamed: the tokens they committed. A
        prompt's prefill is its time to first token, not a per-token latency, so only streams count there
        (a prefill chunk sharing their step still slows them, and shows)."""
        counters = self.counters
        counters.steps += 1
        counters.rows += rows
        counters.tokens += tokens
        counters.forward_s += forward_s
        counters.step_s += step_s
        counters.wide_steps += int(wide)
        logger.debug("step: %d rows, %d tokens, forward %.1f ms, step %.1f ms", rows, tokens, 1000 * forward_s,
                     1000 * step_s)
        if streamed:  # ms per committed token, as a stream of this step saw it: step time x rows / tokens
            samples = [1000 * step_s * streaming_rows / streamed] * min(streaming_rows, 8)
            self.token_ms.extend(samples)
            if rows > 1:
                self.shared_token_ms.extend(samples)

    def heartbeat_fields(self) -> dict:
        """The heartbeat's figures: acceptance over recent rounds, p50/p99 per-token latency, the counters."""
        rounds, token_ms = list(self.rounds), sorted(self.token_ms)
        return {
            "num_draft_tokens": sum(drafted for drafted, _ in rounds),
            "num_accepted_tokens": sum(accepted for _, accepted in rounds),
            "latency_p50_ms": token_ms[len(token_ms) // 2] if token_ms else None,
            "latency_p99_ms": _p99(token_ms),
            "latency_p99_shared_ms": _p99(sorted(self.shared_token_ms)),
            "batch_rows": self.counters.mean_rows,
            "step_counters": asdict(self.counters),
            "stage_times": asdict(self.stages),
        }


def _p99(ordered: list[float]) -> float | None:
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else None
