"""The verify worker's word to remote drafts on its load: draft, or target-only rounds, by what its steps measured.

A remote draft's cost model prices a drafted round and a target-only one from profiles: the verify worker's
step grid on the threads it verifies on, the draft's step. What a live round costs differs from both, and by
how much differs from box to box: on one box the verify worker runs target-only steps on every core
(worker.wide_threads) but drafted ones on its own, the draft worker's core being busy; a round costs building
rows, commits and, for a remote draft, a trip over the link; drafting overlaps verification (pipelined). On a
2-core AMX Xeon the cost model kept drafting at 4 streams, where the plain route ran 1.33x faster.

So, as co-located drafting does (services/speculative/measured_turns.py), the verify worker measures. Its
word at a load, carried in every verdict (Verdict.load_arm), is an arm: "plain" makes the next block ask for
WORD_PLAIN_ROUNDS target-only rounds; "" leaves the block to the draft's own cost model (which may still say
plain). An arm is held at a load bucket (the sessions held) for a hold: it starts once a step saw every remote
speculative session in the arm (each hears the word at its own next verdict), and measures the committed tokens
per second of the HOLD_STEPS steps after that (all of them: sessions arriving and ending, drafts deciding on
their own, are how the arm runs; the SETTLE_STEPS first, steps that prefilled a prompt and steps where every
session is in its start, before its first block after the opening, left out; steps holding no remote speculative
session, the plain route's alone, are neither arm's and do not count). Per-step figures of pure steps only were
tried first: at 4 streams they measured drafting at 61 tok/s and plain at 45, while the routes ran at 37 and 56
(the slow parts of drafting under churn are the mixed steps). Drafting is measured first, then plain; then the
faster is held and the other tried now and then (MeasuredTurns' trials, counted in holds), so a change of prompts
or machine is seen.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from services.speculative.block_length import WORD_PLAIN_ROUNDS
from services.speculative.measured_turns import DRAFT, PLAIN, MeasuredTurns, load_bucket

MIXED = "mixed"  # a step's remote speculative sessions: some drafting, some in target-only rounds
HOLD_STEPS = WORD_PLAIN_ROUNDS  # steps a hold measures once its sessions switched to its arm
MAX_GAP_S = 2.0  # a step that came longer than this after the one before (idle, a stall) is not measured
# steps after the switch not measured: a switch to drafting starts with the drafts catching up on the tokens
# target-only rounds committed and with no block speculated ahead, which its arm does not pay after
SETTLE_STEPS = 3
# steps a hold waits for every remote session to switch to its arm (each hears the word at its own next verdict,
# after up to WORD_PLAIN_ROUNDS rounds; one whose own cost model asked for more target-only rounds takes longer):
# a hold that never saw them all switched ends unmeasured, and as a trial confirms nothing
MAX_SWITCH_STEPS = 2 * WORD_PLAIN_ROUNDS


def word_turns() -> MeasuredTurns:
    """One measurement per hold; trials counted in holds: the first after 16 holds of the winner, then ever rarer
    while they confirm it (a trial costs a hold of the slower arm and the switches to and from it: at 4 streams
    on a 2-core Xeon, trials every 8 holds kept the route at 0.75x of plain decoding over a 30 s run)."""
    return MeasuredTurns(min_turns=1, explore_every=16, max_explore_every=128, decay=0.7)


@dataclass
class Hold:
    """An arm held at a load: from the first step that saw every remote session in it, HOLD_STEPS steps at that
    load, every one of them (sessions arriving, ending, a draft deciding on its own: the arm as it runs), but the
    SETTLE_STEPS first, measured as one: committed tokens over the time from the step before each."""

    arm: str
    started: bool = False
    steps: int = 0  # since it was taken, then since it started
    tokens: int = 0
    seconds: float = 0.0

    @property
    def over(self) -> bool:
        return self.steps >= (SETTLE_STEPS + HOLD_STEPS if self.started else MAX_SWITCH_STEPS)


@dataclass
class LoadWord:
    turns: MeasuredTurns = field(default_factory=word_turns)
    held: dict[int, Hold] = field(default_factory=dict)  # load bucket -> the arm held there
    _last_end: float | None = None  # when the last step ended

    def word(self, load: int) -> str:
        """What the verdicts of a step at `load` say: "plain" or "" (the draft decides)."""
        return "plain" if self.arm(load) == PLAIN else ""

    def arm(self, load: int) -> str:
        """The arm held at `load`'s bucket; once its hold is over, what the hold measured is kept and the arm
        chosen again (drafting first while young; a trial that measured nothing confirms nothing)."""
        bucket = load_bucket(load)
        hold = self.held.get(bucket)
        if hold is None or hold.over:
            if hold is not None and hold.seconds > 0:
                self.turns.record(load, hold.arm, hold.tokens, hold.seconds)
            elif hold is not None:
                self.turns.forget_trial(bucket)
            hold = self.held[bucket] = Hold(self.turns.choose(load, DRAFT))
        return hold.arm

    def stepped(self, load: int, seen: str | None, tokens: int | None, ended_at: float, *,
                starting: bool = False) -> None:
        """A step at `load` ended at `ended_at` (monotonic seconds), committing `tokens` (None: it prefilled a
        prompt too: not measured); `seen`: the arm its remote speculative sessions were in (DRAFT: every one
        drafting, PLAIN: none, MIXED: some of each, None: none held). A step with no remote speculative session
        (the plain route's alone) says nothing of either arm: it neither counts in a hold nor is measured.
        starting: no remote session in it has had a block after its opening yet (their drafts are still hearing of
        the requests, prefilling, catching up): such a step may start a hold, and is then neither counted nor
        measured. A start is paid once a request, by either arm (drafting pays its draft's prefill, a bridge on
        one core beside it), and a short request is all start: steps of 8-token requests held drafting at one
        stream to target-only rounds where drafting ran 1.2x faster. A step where some sessions start beside
        others past theirs is how the arm runs under churn, and counts: were it left out, a load of short
        requests arriving all the time would never be measured."""
        last_end, self._last_end = self._last_end, ended_at
        hold = self.held.get(load_bucket(load))
        if hold is None or seen is None:
            return
        if not hold.started:
            hold.steps += 1
            if seen == hold.arm:
                hold.started, hold.steps = True, 0
            return
        if starting:
            return
        hold.steps += 1
        if hold.steps > SETTLE_STEPS and tokens is not None and last_end is not None \
                and 0 < ended_at - last_end <= MAX_GAP_S:
            hold.tokens += tokens
            hold.seconds += ended_at - last_end

    def to_dict(self) -> dict[str, dict[str, float]]:
        return self.turns.to_dict()


def remote_arm(busy: list[bool]) -> str | None:
    """What the remote speculative sessions of a step do, from whether each one's draft is busy: all drafting
    (DRAFT), none (PLAIN), some of each (MIXED); None when it holds none."""
    if not busy:
        return None
    return DRAFT if all(busy) else PLAIN if not any(busy) else MIXED
