"""Pipelined drafting's decisions: when a speculated block may be sent, how much drafting it hid."""

import pytest

from services.engine.draft_pipeline import (
    Speculation,
    hidden_seconds,
    speculate,
    speculation_holds,
)
from services.config import SpeculativeSettings
from services.models.drafters.ngram import NgramDrafter
from services.protocol import Verdict
from services.speculative.block_length import BlockLengthController
from services.speculative.params import SamplingParams


def verdict(accepted: int, committed: list[int], finished: bool = False) -> Verdict:
    return Verdict(request_id="r", round=0, num_committed=10, num_draft_tokens=3, num_accepted=accepted,
                   committed_ids=committed, finished=finished)


def spec(guess: int = 9) -> Speculation:
    return Speculation(bonus_guess=guess, draft_ids=[1, 2], draft_probs=None, elapsed_s=0.02, finished_at=100.02)


def test_speculation_holds_only_on_full_acceptance_with_the_guessed_bonus():
    assert speculation_holds(spec(9), 3, verdict(3, [4, 5, 6, 9]))
    assert not speculation_holds(spec(9), 3, verdict(3, [4, 5, 6, 8]))  # other bonus token
    assert not speculation_holds(spec(9), 3, verdict(2, [4, 5, 9]))  # a rejection
    assert not speculation_holds(spec(9), 3, verdict(3, [4, 5, 6, 9], finished=True))


def test_hidden_time_is_the_overlap_with_verification():
    s = spec()  # drafted 100.00 .. 100.02
    assert hidden_seconds(s, sent_at=100.0, verify_finished_at=100.05) == pytest.approx(0.02)  # all hidden
    assert hidden_seconds(s, sent_at=100.0, verify_finished_at=100.01) == pytest.approx(0.01)  # verdict came first
    assert hidden_seconds(s, sent_at=100.0, verify_finished_at=99.0) == 0.0


def test_next_length_assumes_full_acceptance_without_touching_the_controller():
    config = SpeculativeSettings(num_draft_tokens=4, window=1)
    controller = BlockLengthController(config)
    assert controller.after(4, 4) == 4 + config.raise_step
    assert controller.num_draft_tokens == 4


def test_speculate_drafts_the_bonus_guess_then_the_next_block():
    drafter = NgramDrafter(ngram_max=2, ngram_min=1)
    context = [1, 2, 3, 4, 5, 6, 1, 2]
    speculation = speculate(drafter, context, [3], 2, SamplingParams(), None)
    assert speculation.bonus_guess == 4 and speculation.draft_ids == [5, 6]
    assert speculate(drafter, context, [3], 0, SamplingParams(), None) is None
    assert speculate(drafter, context, [], 2, SamplingParams(), None) is None


class CountingDrafter:
    """Stepwise: proposes last token + 1, one token per call."""

    stepwise = True
    name = "count"

    def propose(self, context, num_draft_tokens, sampling, generator):
        from services.models.drafters.base import DraftProposal

        return DraftProposal([context[-1] + 1 + i for i in range(num_draft_tokens)], None)

    def release(self):
        pass


def test_speculation_stops_when_the_verdict_arrives():
    polls = iter([False, False, True])
    cut = speculate(CountingDrafter(), [1, 2], [3], 6, SamplingParams(), None, verdict_ready=lambda: next(polls),
                    poll_every_s=0.0)
    assert cut.bonus_guess == 4 and cut.draft_ids == [5]  # two tokens drafted, then the verdict was in
    assert speculate(CountingDrafter(), [1, 2], [3], 6, SamplingParams(), None, verdict_ready=lambda: True,
                     poll_every_s=0.0) is None


def test_a_non_stepwise_drafter_speculates_the_block_that_round_would_draft():
    drafter = NgramDrafter(ngram_max=2, ngram_min=1)
    context = [1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    speculation = speculate(drafter, context[:-1], [3], 4, SamplingParams(), None, poll_every_s=0.0)
    guess = speculation.bonus_guess
    assert guess == 4
    assert speculation.draft_ids == drafter.propose([*context, guess], 4, SamplingParams(), None).token_ids


def test_an_openings_speculation_judges_the_load_by_the_sessions_its_draft_worker_holds_when_it_starts():
    """A session created first in a burst saw one draft session; by the time its opening's speculation starts the
    driver holds sixteen, where this profile (one box's, measured) says plain: no speculation, so no draft
    prefill for a session that will not draft."""
    from services.engine.draft_session import DraftSession
    from services.models.drafters import DraftSource
    from services.protocol import SessionSpec
    from services.speculative.cost_model import CostModel
    from tests.conftest import build_tiny_llama

    profile = {"verify_ms_1": 42.1, "verify_ms_3": 70.7, "verify_ms_5": 85.3, "verify_ms_9": 97.0,
               "step_ms_16x1": 120.5, "step_ms_16x2": 169.3, "step_ms_16x3": 213.7, "step_ms_16x5": 308.6,
               "step_ms_16x9": 496.7, "draft_step_ms_16": 110.8}
    cost = CostModel.from_profile(profile, 8.6)
    drafter = DraftSource("tiny", build_tiny_llama(1)).new_drafter()

    def opened(name: str) -> DraftSession:
        spec = SessionSpec(request_id=name, prompt_ids=[1, 2, 3, 4], max_new_tokens=48, opened=True)
        return DraftSession(spec, [], drafter=drafter, speculative=SpeculativeSettings(prior_acceptance=0.9),
                            cost=cost, reply_to="inbox", pipelined=True, draft_sessions=1)

    alone, in_a_burst = opened("alone"), opened("burst")
    assert alone.will_draft and alone.speculation() is not None
    in_a_burst.observe_draft_sessions(16)
    assert not in_a_burst.will_draft and in_a_burst.speculation() is None
