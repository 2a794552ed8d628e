"""Drafting or plain decoding at a given load, decided by what this worker's own turns measured.

A verify worker that drafts for its own sessions (co-located drafting) runs turns: draft every session's
next block, then one target step over all of them. The cost model predicts which pays at each load from
profiles measured at start-up, but a live turn costs more than its forward (building rows, the round math,
commits, a new session's prefill chunk), and by how much differs from box to box: on a 2-core VM the model
picked blocks of 2 at 8 streams and the stack gave 0.67x of its own plain route. So the choice is measured
instead: per load bucket (the sessions in the turn: 1, 2, 3, 4, 6, 8, 12, 16, ... rounded down), the
committed tokens per second of turns that drafted and of turns that did not (decayed sums of tokens and of
seconds; turns with a prompt's prefill chunk are left out, as both arms pay for those alike); the
worker takes the better arm and tries the other one now and then, so a change of acceptance, prompts or
machine speed is seen. An arm seen fewer than `min_turns` times is tried first (the cost model's pick
first), so a bucket decides after a few turns of each. A trial costs more than its turn (a drafting turn
after plain ones first catches the draft's KV up on the tokens it skipped), so while trials keep confirming
the winner they come ever rarer: every `explore_every`-th turn of the bucket, then twice as far apart after
each confirmation, up to `max_explore_every`; a trial that turns the choice around starts over.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DRAFT, PLAIN = "draft", "plain"


def load_bucket(load: int) -> int:
    """The largest of 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers of two and their halfway points) at or below
    `load` (at least 1): loads alike share their measurements."""
    load, bucket, power = max(1, load), 1, 2
    while power <= load:
        bucket = power
        if power * 3 // 2 <= load and power >= 2:
            bucket = power * 3 // 2
        power *= 2
    return bucket


@dataclass
class ArmFigures:
    tokens: float = 0.0  # committed, decayed: older turns weigh less
    seconds: float = 0.0  # the turns' time, decayed alike
    turns: int = 0

    @property
    def rate(self) -> float:
        """Committed tokens per second (a ratio of sums: a long turn weighs by its length)."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class MeasuredTurns:
    """Per load bucket, the tokens per second of drafting turns and plain turns; the arm to run next."""

    min_turns: int = 4
    explore_every: int = 16
    max_explore_every: int = 256
    decay: float = 0.9  # what the sums keep of themselves at each new turn
    arms: dict[tuple[int, str], ArmFigures] = field(default_factory=dict)
    _since_trial: dict[int, int] = field(default_factory=dict)  # bucket -> turns since its last trial
    _interval: dict[int, int] = field(default_factory=dict)  # bucket -> turns between its trials now
    _trial: dict[int, str] = field(default_factory=dict)  # bucket -> the winner when its pending trial began

    def figures(self, load: int, arm: str) -> ArmFigures:
        return self.arms.setdefault((load_bucket(load), arm), ArmFigures())

    def choose(self, load: int, predicted: str) -> str:
        """The arm for the next turn at `load`; `predicted` (the cost model's pick) goes first while both
        arms are young, and breaks a tie."""
        bucket = load_bucket(load)
        other = PLAIN if predicted == DRAFT else DRAFT
        first, second = self.figures(load, predicted), self.figures(load, other)
        if first.turns < self.min_turns:
            return predicted
        if second.turns < self.min_turns:
            return other
        better, worse = (other, predicted) if second.rate > first.rate else (predicted, other)
        if bucket in self._trial:  # the last trial is measured by now: did it confirm the winner?
            confirmed = self._trial.pop(bucket) == better
            interval = self._interval.get(bucket, self.explore_every)
            self._interval[bucket] = min(interval * 2, self.max_explore_every) if confirmed else self.explore_every
        since = self._since_trial[bucket] = self._since_trial.get(bucket, 0) + 1
        if since >= self._interval.get(bucket, self.explore_every):
            self._since_trial[bucket] = 0
            self._trial[bucket] = better
            return worse
        return better

    def record(self, load: int, arm: str, tokens: int, seconds: float) -> None:
        """A finished turn: `tokens` committed in `seconds` (drafting and step)."""
        if seconds <= 0:
            return
        figures = self.figures(load, arm)
        figures.tokens = self.decay * figures.tokens + tokens
        figures.seconds = self.decay * figures.seconds + seconds
        figures.turns += 1

    def to_dict(self) -> dict[str, dict[str, float]]:
        """{bucket: {"draft": tok/s, "plain": tok/s}} for the heartbeat and the dashboard."""
        table: dict[str, dict[str, float]] = {}
        for (bucket, arm), figures in sorted(self.arms.items()):
            if figures.turns:
                table.setdefault(str(bucket), {})[arm] = round(figures.rate, 1)
        return table
