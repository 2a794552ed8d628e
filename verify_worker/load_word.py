"""The verify worker's word to remote drafts on its load: draft, or target-only rounds, by what its steps measured.

A remote draft's cost model prices a drafted round and a target-only one from profiles: the verify worker's
step grid on the threads it verifies on, the draft's step. What a live round costs differs from both, and by
how much differs from box to box: on one box the verify worker runs target-only steps on every core
(worker.wide_threads) but drafted ones on its own, the draft worker's core being busy; a round costs building
rows, commits and, for a remote draft, a trip over the link; drafting overlaps verification (pipelined). On a
2-core AMX Xeon the cost model kept drafting at 4 streams, where the plain route ran 1.33x faster.

So, as co-located drafting does (services/speculative/measured_turns.py), the verify worker measures: per
load bucket (the sessions it holds), the committed tokens per second of its steps while every remote
speculative session drafts, and while none does (target-only rounds the load or the word asked for). Its
word at that load, carried in every verdict (Verdict.load_arm), is the faster arm: "plain" makes the next
block ask for WORD_PLAIN_ROUNDS target-only rounds; "" leaves the block to the draft's own cost model (which
may still say plain). A remote session hears the word at its next verdict, so an arm is held HOLD_STEPS steps
at a load before it is chosen again, and a step is measured only after SETTLE_STEPS steps at the same load in
the same arm (a switch, a session arriving or ending, a prompt's prefill and what follows them at once are not
measured: a switch to drafting starts with its drafts catching up and nothing speculated ahead). The other arm
is tried now and then (MeasuredTurns' trials, counted in holds), so a change of prompts or machine is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.speculative.block_length import WORD_PLAIN_ROUNDS
from services.speculative.measured_turns import DRAFT, PLAIN, MeasuredTurns, load_bucket

HOLD_STEPS = WORD_PLAIN_ROUNDS  # steps an arm is held at a load: a block of target-only rounds hears the next word
MAX_GAP_S = 2.0  # a step that came longer than this after the one before (idle, a stall) is not measured
# steps alike (same load, same arm) before one is measured: a switch to drafting starts with the drafts catching up
# on the tokens target-only rounds committed and with no block speculated ahead, which its arm does not pay after
SETTLE_STEPS = 3


def word_turns() -> MeasuredTurns:
    """Trials counted in holds: the first after 8 holds of the winner, then ever rarer while they confirm it (a
    trial of target-only rounds where drafting wins costs a hold of them and the drafts' catch-up after it; at one
    stream on a 2-core Xeon, trials every 4 to 32 holds cost about 5%). A step is shorter than a co-located turn
    and its tokens vary more (a drafted round commits 1 to gamma + 1): the sums forget more slowly."""
    return MeasuredTurns(min_turns=HOLD_STEPS // 2, explore_every=8, max_explore_every=64, decay=0.97)


@dataclass
class LoadWord:
    turns: MeasuredTurns = field(default_factory=word_turns)
    _held: dict[int, list] = field(default_factory=dict)  # load bucket -> [arm, steps left]
    _last: tuple[int, str, float] | None = None  # the last step: its load bucket, the arm seen, when it ended
    _alike: int = 0  # steps in a row at that load in that arm

    def word(self, load: int, choose: bool = True) -> str:
        """What the verdicts of a step at `load` say: "plain" or "" (the draft decides). choose False: the word
        held at that load now, if any, without choosing again."""
        return "plain" if self.arm(load, choose) == PLAIN else ""

    def arm(self, load: int, choose: bool = True) -> str | None:
        """The arm held at `load`'s bucket, chosen again once its hold is over (drafting first while young)."""
        bucket = load_bucket(load)
        held = self._held.get(bucket)
        if not choose:
            return held[0] if held is not None else None
        if held is None or held[1] <= 0:
            held = self._held[bucket] = [self.turns.choose(load, DRAFT), HOLD_STEPS]
        return held[0]

    def stepped(self, load: int, seen: str | None, tokens: int | None, ended_at: float) -> None:
        """A step at `load` ended at `ended_at` (monotonic seconds), committing `tokens` (None: it prefilled a
        prompt too); `seen`: the arm its remote speculative sessions were in (DRAFT: every one drafting, PLAIN:
        none, None: mixed or none held). Measured from the end of the step before, when that one was alike."""
        bucket = load_bucket(load)
        held = self._held.get(bucket)
        if held is not None:
            held[1] -= 1
        last, self._last = self._last, (bucket, seen, ended_at) if seen is not None and tokens is not None else None
        if self._last is None or last is None or last[:2] != (bucket, seen) or not 0 < ended_at - last[2] <= MAX_GAP_S:
            self._alike = 0
            return
        self._alike += 1
        if self._alike > SETTLE_STEPS:
            self.turns.record(load, seen, tokens, ended_at - last[2])

    def to_dict(self) -> dict[str, dict[str, float]]:
        return self.turns.to_dict()
