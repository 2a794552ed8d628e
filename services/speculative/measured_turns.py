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
machine speed is seen. Drafting's figure is charged what its turns leave out: the draft's prefill of each
session's prompt, per output token (the caller's draft_cost_s). An arm seen fewer than `min_turns` times is
tried first (the cost model's pick first), so a bucket decides after a few turns of each. A trial costs more
than its turn (a drafting turn after plain ones first catches the draft's KV up on the tokens it skipped), so
while trials keep confirming the winner they come ever rarer: every `explore_every`-th turn of the bucket,
then twice as far apart after each confirmation, up to `max_explore_every`; a trial that turns the choice
around starts over.
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

    def rate(self, bucket: int, arm: str, draft_cost_s: float = 0.0) -> float:
        """The arm's committed tokens per second at `bucket`; drafting's with `draft_cost_s` more per token
        (what its turns leave out: the draft's prefill of each session's prompt, spread over its output)."""
        rate = self.arms.get((bucket, arm), ArmFigures()).rate
        if arm == DRAFT and rate > 0 and draft_cost_s > 0:
            rate = 1.0 / (1.0 / rate + draft_cost_s)
        return rate

    def winner(self, bucket: int, draft_cost_s: float = 0.0) -> str | None:
        """The faster arm at `bucket`, once both were seen min_turns times; None before."""
        if any(self.arms.get((bucket, arm), ArmFigures()).turns < self.min_turns for arm in (DRAFT, PLAIN)):
            return None
        return DRAFT if self.rate(bucket, DRAFT, draft_cost_s) > self.rate(bucket, PLAIN) else PLAIN

    def choose(self, load: int, predicted: str, draft_cost_s: float = 0.0, explore: bool = True) -> str:
        """The arm for the next turn at `load`; `predicted` (the cost model's pick) goes first while both
        arms are young. Drafting pays less the more rows share a step, so while plain decoding wins at a
        lighter load, a heavier one where drafting was not measured yet decodes plain without trying it (a
        trial that reverses the lighter load's winner opens it again). draft_cost_s: see rate(). explore False:
        where drafting was not measured yet and plain is predicted, trust the prediction (a drafting trial
        costs the drafts' catch-up, and a prediction that already charges it errs toward drafting, not away)."""
        bucket = load_bucket(load)
        young = self.figures(load, DRAFT).turns < self.min_turns
        if young and not explore and predicted == PLAIN:
            return PLAIN
        if young and any(
                lighter < bucket and self.winner(lighter, draft_cost_s) == PLAIN
                for lighter, _ in list(self.arms)):
            return PLAIN
        other = PLAIN if predicted == DRAFT else DRAFT
        first, second = self.figures(load, predicted), self.figures(load, other)
        if first.turns < self.min_turns:
            return predicted
        if second.turns < self.min_turns:
            return other
        better = self.winner(bucket, draft_cost_s)
        worse = PLAIN if better == DRAFT else DRAFT
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

    def forget_trial(self, bucket: int) -> None:
        """The pending trial at `bucket` measured too little to confirm or reverse anything: the next one comes
        at the same interval, not twice as late."""
        self._trial.pop(bucket, None)

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


@dataclass
class DraftPrefillCost:
    """What a session's drafting costs before its blocks, per output token: the draft's prefill of its prompt
    (the part the draft reads), at the rate the draft prefilled at here, spread over the output sessions get.
    Drafting turns leave that prefill out (it is paid a piece at a time, with a turn's sessions still
    waiting for it decoding plain), so the choice between the arms adds it back to drafting's figure."""

    decay: float = 0.95
    seconds: float = 0.0  # the draft's prefills, decayed
    tokens: float = 0.0
    prompt_tokens: float = 0.0  # of finished sessions: the prompt tokens their draft reads, decayed
    output_tokens: float = 0.0  # and the tokens they produced

    def prefilled(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            self.tokens = self.decay * self.tokens + tokens
            self.seconds = self.decay * self.seconds + seconds

    def finished(self, prompt_tokens: int, output_tokens: int) -> None:
        self.prompt_tokens = self.decay * self.prompt_tokens + prompt_tokens
        self.output_tokens = self.decay * self.output_tokens + max(1, output_tokens)

    @property
    def per_output_token_s(self) -> float:
        """Seconds of draft prefill per output token; 0 until a prefill and a finished session were seen."""
        if self.tokens <= 0 or self.output_tokens <= 0:
            return 0.0
        return (self.seconds / self.tokens) * (self.prompt_tokens / self.output_tokens)
