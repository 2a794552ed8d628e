"""The verify worker's word on its load to remote drafts (verify_worker/load_word.py), and how a draft session
takes it: measured steps, not predictions, decide between drafted and target-only rounds at a load."""

from services.config import SpeculativeSettings
from services.protocol import SessionSpec, Verdict
from services.speculative.block_length import WORD_PLAIN_ROUNDS, BlockLengthController
from services.speculative.measured_turns import DRAFT, PLAIN, load_bucket
from verify_worker.load_word import HOLD_STEPS, MAX_GAP_S, MAX_SWITCH_STEPS, MIXED, SETTLE_STEPS, LoadWord, remote_arm


def run(word: LoadWord, load: int, tokens_per_step: int, step_s: float, clock: list[float],
        seen: str | None = "follow") -> set[str]:
    """One hold at `load`: steps committing tokens_per_step each step_s apart, every remote session in the arm the
    word holds (seen "follow") or as `seen` says, until the word's hold there is over; the words they carried."""
    said, hold = set(), None
    while True:
        current = word.word(load)
        if hold is not None and word.held[load_bucket(load)] is not hold:
            return said  # the next hold began with `current`
        hold = word.held[load_bucket(load)]
        said.add(current)
        clock[0] += step_s
        arm = (PLAIN if current == "plain" else DRAFT) if seen == "follow" else seen
        word.stepped(load, arm, tokens_per_step, clock[0])


def test_drafting_is_tried_first_then_plain_then_the_faster_one_is_held():
    word, clock = LoadWord(), [0.0]
    assert run(word, 4, 4 * 3, 0.30, clock) == {""}  # drafting first: 40 tok/s
    assert run(word, 4, 4, 0.08, clock) == {"plain"}  # then plain: 50 tok/s
    assert [run(word, 4, 4, 0.08, clock) for _ in range(15)] == [{"plain"}] * 15  # held
    assert word.to_dict()["4"] == {"draft": 40.0, "plain": 50.0}
    assert run(word, 4, 4 * 3, 0.30, clock) == {""}  # then a drafting trial
    assert run(word, 4, 4, 0.08, clock) == {"plain"}  # which confirmed plain


def test_a_hold_measures_its_arm_after_every_session_switched_and_settled_mixed_steps_included():
    word, clock = LoadWord(), [0.0]
    assert word.word(2) == ""
    for _ in range(5):  # not every session drafts yet: the hold has not started
        clock[0] += 1.0
        word.stepped(2, MIXED, 100, clock[0])
    hold = word.held[2]
    assert not hold.started and hold.tokens == 0
    clock[0] += 1.0
    word.stepped(2, DRAFT, 100, clock[0])  # all drafting: it starts, and SETTLE_STEPS more are not measured
    for _ in range(SETTLE_STEPS):
        clock[0] += 1.0
        word.stepped(2, DRAFT, 100, clock[0])
    assert hold.started and hold.tokens == 0
    clock[0] += 0.5
    word.stepped(2, MIXED, 3, clock[0])  # a session arriving or ending mid-hold: measured
    clock[0] += 0.5
    word.stepped(2, DRAFT, None, clock[0])  # it prefilled a prompt: not measured
    clock[0] += MAX_GAP_S + 0.5
    word.stepped(2, DRAFT, 7, clock[0])  # after an idle gap: not measured
    clock[0] += 0.25
    word.stepped(2, DRAFT, 5, clock[0])
    assert (hold.tokens, hold.seconds) == (8, 0.75)


def test_a_trial_that_never_started_confirms_nothing():
    """Under load sessions switch arms at their own verdicts, and a draft may decide plain on its own: a trial can
    end without ever seeing every session drafting. The next trial then comes as soon as that one did."""
    word, clock = LoadWord(), [0.0]
    assert run(word, 4, 12, 0.30, clock) == {""}  # drafting: 40 tok/s
    assert run(word, 4, 4, 0.08, clock) == {"plain"}  # plain: 50 tok/s
    assert [run(word, 4, 4, 0.08, clock) for _ in range(15)] == [{"plain"}] * 15
    assert run(word, 4, 4, 0.1, clock, seen=MIXED) == {""}  # the drafting trial: its sessions never all drafted
    assert not word.turns.arms[(4, DRAFT)].turns > 1
    assert [run(word, 4, 4, 0.08, clock) for _ in range(15)] == [{"plain"}] * 15
    assert run(word, 4, 4, 0.1, clock, seen=MIXED) == {""}  # tried again after 16 holds, not 32
    assert [run(word, 4, 4, 0.08, clock) for _ in range(15)] == [{"plain"}] * 15
    assert run(word, 4, 12, 0.30, clock) == {""}  # measured this time, and it confirms plain
    assert [run(word, 4, 4, 0.08, clock) for _ in range(31)] == [{"plain"}] * 31  # so the next comes after 32


def test_steps_without_a_remote_speculative_session_measure_no_arm():
    """The plain route's requests between a speculative stream's (one verify worker serving both, a bench taking
    turns between the routes): their steps are neither arm's. They used to count in the hold that was running, at
    the plain route's speed, and to run out a hold waiting for sessions to switch."""
    assert remote_arm([]) is None and remote_arm([True, False]) == MIXED
    word, clock = LoadWord(), [0.0]
    assert word.word(1) == ""
    hold = word.held[1]
    for _ in range(1 + SETTLE_STEPS):
        clock[0] += 0.125
        word.stepped(1, DRAFT, 3, clock[0])
    clock[0] += 0.125
    word.stepped(1, DRAFT, 3, clock[0])
    for _ in range(8):  # a plain-route request: one token a step
        clock[0] += 0.0625
        word.stepped(1, None, 1, clock[0])
    clock[0] += 0.125
    word.stepped(1, DRAFT, 3, clock[0])  # the stream again: measured from the step before, as any
    assert (hold.tokens, hold.seconds, hold.steps) == (6, 0.25, SETTLE_STEPS + 2)
    waiting = LoadWord()
    waiting.word(1)
    for _ in range(2 * MAX_SWITCH_STEPS):  # no speculative session at all: the hold waits for one
        waiting.stepped(1, None, 1, 1.0)
    assert not waiting.held[1].over and waiting.held[1].steps == 0


def test_a_sessions_start_neither_counts_in_a_hold_nor_is_measured():
    """Steps while a remote session has had no block after its opening (its draft hears of the request, prefills,
    catches up): a short request is all start, and its one-core bridge used to be measured as the drafting arm."""
    word, clock = LoadWord(), [0.0]
    assert word.word(1) == ""
    hold = word.held[1]
    clock[0] += 0.05
    word.stepped(1, DRAFT, 1, clock[0], starting=True)  # every session in the arm: the hold starts
    assert hold.started and hold.steps == 0
    for _ in range(3 * HOLD_STEPS):  # requests of a few tokens, all start: 20 tok/s
        clock[0] += 0.05
        word.stepped(1, DRAFT, 1, clock[0], starting=True)
    assert (hold.steps, hold.tokens, hold.over) == (0, 0, False) and word.word(1) == ""
    for _ in range(SETTLE_STEPS + HOLD_STEPS):  # then a request past its start: 3 tokens a step, 50 tok/s
        clock[0] += 0.06
        word.stepped(1, DRAFT, 3, clock[0])
    assert hold.over and (hold.tokens, round(hold.seconds, 6)) == (3 * HOLD_STEPS, round(0.06 * HOLD_STEPS, 6))
    assert word.word(1) == "plain"  # the plain arm's turn: measured as drafting's was
    assert word.to_dict()["1"]["draft"] == 50.0


def test_where_drafting_is_faster_the_word_leaves_the_block_to_the_draft():
    word, clock = LoadWord(), [0.0]
    run(word, 1, 4, 0.12, clock)  # drafting: 33 tok/s
    run(word, 1, 1, 0.04, clock)  # plain: 25 tok/s
    assert run(word, 1, 4, 0.12, clock) == {""}


def test_loads_are_measured_apart_and_a_lighter_loads_plain_win_carries_to_heavier_ones():
    word, clock = LoadWord(), [0.0]
    run(word, 4, 4, 0.3, clock)
    run(word, 4, 4, 0.08, clock)
    assert word.word(1) == ""  # a lighter load knows nothing yet: drafting first
    assert word.word(8) == "plain"  # drafting lost at 4 rows: it pays less at 8


def test_the_word_plain_makes_the_controller_ask_for_target_only_rounds_and_nothing_else():
    config = SpeculativeSettings(block_policy="acceptance")
    controller = BlockLengthController(config)
    gamma = controller.num_draft_tokens
    assert gamma > 0 and controller.num_plain_rounds == 0
    controller.observe_load(4, word="plain")
    assert controller.num_draft_tokens == 0 and controller.num_plain_rounds == WORD_PLAIN_ROUNDS
    assert not controller.fallen_back and controller.after(gamma, gamma) == 0  # no speculation for a plain block
    controller.observe_load(4, word="")
    assert controller.num_draft_tokens == gamma


def test_a_draft_session_hears_the_word_in_its_verdict_and_sends_target_only_rounds():
    from services.engine.draft_session import DraftSession
    from services.models.drafters.batched import propose_many
    from services.models.drafters.ngram import NgramDrafter

    spec = SessionSpec(request_id="r", prompt_ids=[1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=64)
    session = DraftSession(spec, [], drafter=NgramDrafter(), speculative=SpeculativeSettings(), cost=None,
                           reply_to="inbox", pipelined=False)
    first = session.next_block(propose_many([session.draft_call()])[0])
    assert first.draft_ids and first.num_rounds == 1
    session.sent(first, b"", "verify-w")
    told = Verdict(request_id="r", round=0, num_committed=9, num_draft_tokens=len(first.draft_ids),
                   num_accepted=0, committed_ids=[3], load_arm="plain", worker_id="verify-w")
    session.on_verdict(told)
    assert session.draft_call() is None
    plain = session.next_block()
    assert plain.draft_ids == [] and plain.num_rounds == WORD_PLAIN_ROUNDS
    session.sent(plain, b"", "verify-w")
    session.on_verdict(Verdict(request_id="r", round=1, num_committed=9 + WORD_PLAIN_ROUNDS, num_draft_tokens=0,
                               num_accepted=0, committed_ids=[1, 2, 3] * 5 + [1], num_rounds=WORD_PLAIN_ROUNDS,
                               worker_id="verify-w"))
    assert session.draft_call() is not None  # the word is "" again: the draft decides, and drafts
    assert session.summary().plain_reason == "load"  # and its record says why it ran target-only rounds


def test_a_seeded_sampled_session_ignores_the_word_where_its_rounds_fall_decides_its_tokens():
    from services.engine.draft_session import DraftSession
    from services.models.drafters.batched import propose_many
    from services.models.drafters.ngram import NgramDrafter
    from services.speculative.params import SamplingParams

    def told(sampling: SamplingParams) -> DraftSession:
        spec = SessionSpec(request_id="r", prompt_ids=[1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=64, sampling=sampling)
        session = DraftSession(spec, [], drafter=NgramDrafter(), speculative=SpeculativeSettings(), cost=None,
                               reply_to="inbox", pipelined=False)
        session.sent(session.next_block(propose_many([session.draft_call()])[0]), b"", "verify-w")
        session.on_verdict(Verdict(request_id="r", round=0, num_committed=9, num_draft_tokens=2, num_accepted=0,
                                   committed_ids=[3], load_arm="plain", worker_id="verify-w"))
        return session

    assert told(SamplingParams(temperature=0.8, seed=7)).draft_call() is not None  # drafts on: its layout is its seed's
    assert told(SamplingParams(temperature=0.8)).draft_call() is None  # unseeded: any layout samples alike
    assert told(SamplingParams()).draft_call() is None  # greedy


def test_a_session_started_after_its_opening_was_answered_hears_that_verdict_not_what_others_heard_before():
    """A burst's first request: the gateway sent its opening, answered before its draft task started (with the
    load of the burst that came in meanwhile, verify_worker/told_load.py). The draft worker's other sessions last
    heard "" at one row, before the burst."""
    from services.engine.draft_session import DraftSession
    from services.models.drafters.ngram import NgramDrafter
    from services.protocol import OutputEvent
    from services.speculative.block_length import RecentRounds

    spec = SessionSpec(request_id="r", prompt_ids=[1, 2, 3, 1, 2, 3, 1, 2], max_new_tokens=64, opened=True)
    events = [OutputEvent(request_id="r", seq=0, token_ids=[3], num_output_tokens=1)]
    recent = RecentRounds()
    recent.observe(4, 4, rows=1, word="")
    opening = Verdict(request_id="r", round=0, num_committed=9, num_draft_tokens=0, num_accepted=0,
                      committed_ids=[3], load_arm="plain", batch_rows=13, worker_id="verify-w")

    def started(told: Verdict | None) -> DraftSession:
        return DraftSession(spec, events, drafter=NgramDrafter(), speculative=SpeculativeSettings(), cost=None,
                            reply_to="inbox", pipelined=False, recent=recent, draft_sessions=1, told=told)

    assert started(None).draft_call() is not None  # what the others heard: it drafts
    session = started(opening)
    assert session.controller.rows == 13 and session.draft_call() is None
    assert session.next_block().num_rounds == WORD_PLAIN_ROUNDS
    # resumed later (a failover at round 2): the opening's verdict is old news, what the others heard holds
    events.append(OutputEvent(request_id="r", seq=1, token_ids=[1], num_output_tokens=2))
    later = started(opening)
    assert later.controller.rows == 1 and later.draft_call() is not None
