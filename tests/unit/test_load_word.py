"""The verify worker's word on its load to remote drafts (verify_worker/load_word.py), and how a draft session
takes it: measured steps, not predictions, decide between drafted and target-only rounds at a load."""

from services.config import SpeculativeSettings
from services.protocol import SessionSpec, Verdict
from services.speculative.block_length import WORD_PLAIN_ROUNDS, BlockLengthController
from services.speculative.measured_turns import DRAFT, PLAIN
from verify_worker.load_word import HOLD_STEPS, MAX_GAP_S, SETTLE_STEPS, LoadWord


def run(word: LoadWord, load: int, tokens_per_step: int, step_s: float, clock: list[float]) -> list[str]:
    """One hold of steps at `load` in the arm the word holds, committing tokens_per_step each step_s apart;
    the words the steps' verdicts carried."""
    said = []
    for _ in range(HOLD_STEPS):
        said.append(word.word(load))
        clock[0] += step_s
        word.stepped(load, PLAIN if said[-1] == "plain" else DRAFT, tokens_per_step, clock[0])
    return said


def test_drafting_is_tried_first_then_plain_then_the_faster_one_is_held():
    word, clock = LoadWord(), [0.0]
    assert set(run(word, 4, 4 * 3, 0.30, clock)) == {""}  # drafting first: 40 tok/s
    assert set(run(word, 4, 4, 0.08, clock)) == {"plain"}  # then plain: 50 tok/s
    assert [set(run(word, 4, 4, 0.08, clock)) for _ in range(7)] == [{"plain"}] * 7  # held
    assert word.to_dict()["4"] == {"draft": 40.0, "plain": 50.0}
    assert set(run(word, 4, 4 * 3, 0.30, clock)) == {""}  # then a drafting trial
    assert set(run(word, 4, 4, 0.08, clock)) == {"plain"}  # which confirmed plain


def test_where_drafting_is_faster_the_word_leaves_the_block_to_the_draft():
    word, clock = LoadWord(), [0.0]
    run(word, 1, 4, 0.12, clock)  # drafting: 33 tok/s
    run(word, 1, 1, 0.04, clock)  # plain: 25 tok/s
    assert set(run(word, 1, 4, 0.12, clock)) == {""}


def test_loads_are_measured_apart_and_a_lighter_loads_plain_win_carries_to_heavier_ones():
    word, clock = LoadWord(), [0.0]
    run(word, 4, 4, 0.3, clock)
    run(word, 4, 4, 0.08, clock)
    assert word.word(1) == ""  # a lighter load knows nothing yet: drafting first
    assert word.word(8) == "plain"  # drafting lost at 4 rows: it pays less at 8


def test_a_step_after_a_switch_a_gap_or_a_mixed_step_is_not_measured():
    word = LoadWord()
    for step in range(SETTLE_STEPS + 2):  # settled after SETTLE_STEPS alike: the last one is measured
        word.stepped(2, DRAFT, 6, 1.0 + step / 4)  # 6 tokens in 0.25 s
    word.stepped(2, PLAIN, 2, 1.3)  # a switch: not measured
    word.stepped(2, PLAIN, 2, 1.3 + MAX_GAP_S + 0.1)  # after an idle gap: not measured
    word.stepped(2, None, 2, 4.0)  # some sessions drafting, some not
    word.stepped(2, PLAIN, 2, 4.1)
    word.stepped(2, PLAIN, None, 4.2)  # it prefilled a prompt too
    word.stepped(2, PLAIN, 2, 4.3)
    word.stepped(3, PLAIN, 3, 4.4)  # another load
    for step in range(SETTLE_STEPS):  # alike again, not settled yet
        word.stepped(3, PLAIN, 3, 4.5 + step / 10)
    figures = word.turns.arms
    assert figures[(2, DRAFT)].turns == 1 and figures[(2, DRAFT)].rate == 24.0
    assert all(figures[key].turns == 0 for key in figures if key != (2, DRAFT))


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
