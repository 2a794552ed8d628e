"""Co-located drafting (placement local) against a real Redis and a verify worker thread, on tiny models: the
verify worker drafts for its own sessions in-process, and the output is target-only decoding's token for token,
and for a seeded sampled request the same as when a draft worker drafts it; a cancellation ends the stream and
frees both caches; a session whose worker died resumes on another from its committed output."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from services.config import SpeculativeSettings, SuffixSettings
from services.history_feed import HISTORY_PROMPT_TAIL, HistoryFeed
from services.models.drafters import DraftSource
from services.protocol import (
    HISTORY_STREAM_KEY,
    FinishedOutput,
    Heartbeat,
    SessionSpec,
    cancel_key,
    heartbeat_key,
    owner_key,
)
from services.speculative.block_length import RecentRounds
from services.speculative.cost_model import CostModel, best_block_length
from services.speculative.measured_turns import DRAFT, PLAIN, MeasuredTurns
from services.speculative.params import SamplingParams
from tests.conftest import build_tiny_llama, perturbed_copy
from tests.integration.fleet import (
    VerifyThread,
    draft_runtime,
    empty_redis,
    output_tokens,
    reference,
    start_local,
    submit_spec,
    wait_finished,
)
from verify_worker.local_drafts import (
    EXPLORE_ALPHA,
    EXPLORE_GAIN,
    MAX_CARRIED_TURNS,
    WARM_PAYBACK,
    LocalDrafting,
)

PROMPTS = [[5, 9, 13, 2, 40, 41, 7, 7, 30, 12, 5, 9, 13], [3, 3, 8, 60, 61, 62, 3, 3, 8], [70, 1, 2, 3, 70, 1, 2]]


@pytest.fixture(scope="module")
def target():
    return build_tiny_llama(0)


@pytest.fixture(scope="module")
def draft(target) -> DraftSource:
    return DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))


@pytest.fixture
def client():
    with empty_redis() as connection:
        yield connection


def local(source: DraftSource) -> LocalDrafting:
    return LocalDrafting(source, SpeculativeSettings(block_policy="acceptance"))


def spec_of(request_id: str, prompt: list[int], max_new_tokens: int = 30, **fields) -> SessionSpec:
    return SessionSpec(request_id=request_id, prompt_ids=prompt, max_new_tokens=max_new_tokens, ignore_eos=True,
                       **fields)


@pytest.mark.parametrize("kind", ["model", "model-window", "ngram", "suffix", "suffix-model"])
def test_sessions_drafted_by_their_verify_worker_decode_as_the_target_alone(client, target, draft, kind):
    """model-window: the draft reads the last 4 prompt tokens only (a draft's context is no part of the output);
    suffix-model: per round the suffix draft or the model's."""
    source = {"ngram": DraftSource("ngram", None), "suffix": DraftSource("suffix", None, suffix=SuffixSettings()),
              "suffix-model": DraftSource("suffix:tiny-draft", draft.model, suffix=SuffixSettings())}.get(kind, draft)
    drafting = local(source)
    if kind == "model-window":
        drafting.speculative = SpeculativeSettings(block_policy="acceptance", draft_context_tokens=4)
    verify = VerifyThread(client, target, local=drafting)
    try:
        for index, prompt in enumerate(PROMPTS):  # at once: drafted together, verified in shared steps
            start_local(client, spec_of(f"{kind}-{index}", prompt))
        for index, prompt in enumerate(PROMPTS):
            events = wait_finished(client, f"{kind}-{index}")
            assert output_tokens(client, f"{kind}-{index}") == reference(target, prompt, 30)
            assert events[-1].worker_id == "verify-t"
            assert client.get(owner_key(f"{kind}-{index}")).decode() == verify.worker.instance
        stats = events[-1].stats
        assert stats.num_drafts > 0 and (kind in ("ngram", "suffix") or stats.num_accepted_tokens > 0)
        assert len(verify.worker.sessions) == 0  # finished sessions leave the table (their KV retired)
    finally:
        verify.close()


def test_finished_outputs_reach_the_fleet_history_and_later_sessions_of_the_tenant_draft_from_them(client, target):
    source = DraftSource("suffix", None, suffix=SuffixSettings())
    feed = HistoryFeed(client, source.shared_history())
    verify = VerifyThread(client, target, local=local(source))
    prompt = [70, 71, 72, 73, 74, 75, 76, 77]  # nothing in it repeats: its own context offers no draft
    try:
        start_local(client, spec_of("first", prompt, tenant="key1"))
        wait_finished(client, "first")
        entries = client.xrange(HISTORY_STREAM_KEY)
        assert len(entries) == 1
        published = FinishedOutput.decode(entries[0][1][b"m"])
        assert published.tenant == "key1" and published.output_ids == output_tokens(client, "first")
        assert published.prompt_tail == prompt[-HISTORY_PROMPT_TAIL:]
        feed.read_once()
        assert source.history.num_added == 1
        start_local(client, spec_of("again", prompt, tenant="key1"))
        start_local(client, spec_of("other", prompt, tenant="key2"))
        for request_id in ("again", "other"):
            wait_finished(client, request_id)
            assert output_tokens(client, request_id) == output_tokens(client, "first")
        # the same tenant's repeat is drafted from the history; another tenant's is not
        again, other = _stats(client, "again"), _stats(client, "other")
        assert again.num_accepted_tokens >= 20
        assert other.num_draft_tokens < again.num_draft_tokens
        # the verify worker counted who drafted (DraftBlock.drafter): every round of both was a suffix draft's
        assert again.num_history_drafts > 0 and other.num_history_drafts == 0
        assert again.num_suffix_drafts == again.num_drafts and other.num_suffix_drafts == other.num_drafts
    finally:
        verify.close()


def _stats(client, request_id: str):
    return wait_finished(client, request_id)[-1].stats


def test_a_seeded_sampled_request_is_the_same_drafted_here_or_by_a_draft_worker(client, target, draft):
    verify = VerifyThread(client, target, local=local(draft))
    try:
        start_local(client, spec_of("here", PROMPTS[0], sampling=SamplingParams(temperature=1.0, seed=7)))
        wait_finished(client, "here")
        runtime = draft_runtime(client, draft, pipelined=True)
        try:
            remote = spec_of("remote", PROMPTS[0], sampling=SamplingParams(temperature=1.0, seed=7))
            submit_spec(client, remote)
            runtime.driver.drive(runtime.new_session(remote, []))
        finally:
            runtime.close()
    finally:
        verify.close()
    here = output_tokens(client, "here")
    assert len(here) == 30 and here == output_tokens(client, "remote")


def test_a_cancelled_local_session_ends_its_stream_and_frees_both_caches(client, target, draft):
    verify = VerifyThread(client, target, local=local(draft))
    try:
        client.set(cancel_key("gone"), b"1")  # cancelled before its first round: stopped within one check
        start_local(client, spec_of("gone", PROMPTS[1], max_new_tokens=200))
        events = wait_finished(client, "gone")
        assert events[-1].finish_reason == "cancelled" and events[-1].worker_id == "verify-t"
        deadline = time.monotonic() + 5.0  # the stream's last event goes out before the worker drops the session
        while len(verify.worker.sessions) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(verify.worker.sessions) == 0
        assert verify.worker.engine.store.num_sequences <= 1  # at most its KV, retired for prefix reuse
    finally:
        verify.close()


def test_a_local_session_whose_worker_died_resumes_on_another_from_its_output(client, target, draft):
    first = VerifyThread(client, target, worker_id="verify-a", local=local(draft))
    spec = spec_of("moved", PROMPTS[2], max_new_tokens=60)
    try:
        start_local(client, spec)
        deadline = time.monotonic() + 60
        while len(output_tokens(client, "moved")) < 10:  # some rounds committed there
            assert time.monotonic() < deadline, "no rounds committed on the first worker"
            time.sleep(0.005)
    finally:
        first.close()  # the worker is gone mid-session (its heartbeat would lapse)
    committed = output_tokens(client, "moved")
    assert 10 <= len(committed) < 60
    second = VerifyThread(client, target, worker_id="verify-b", local=local(draft))
    try:
        start_local(client, spec)  # what the gateway's recovery sends for a dead owner
        events = wait_finished(client, "moved")
    finally:
        second.close()
    assert output_tokens(client, "moved") == reference(target, PROMPTS[2], 60)
    assert events[-1].worker_id == "verify-b" and client.get(owner_key("moved")).decode() == \
        second.worker.instance


def test_turns_measure_drafting_against_plain_decoding_and_keep_the_output(client, target, draft):
    """With a cost model and a known acceptance, each turn drafts or not by what turns at its load measured:
    both arms get measured (the predicted one first), the heartbeat carries the figures, and the output is
    still the target's own."""
    recent = RecentRounds()
    for _ in range(60):
        recent.observe(4, 3, rows=1)
    cost = CostModel({1: 10.0, 5: 12.0}, draft_ms_per_token=1.0, pipelined=False)
    drafting = LocalDrafting(draft, SpeculativeSettings(), cost=cost, recent=recent,
                             turns=MeasuredTurns(min_turns=2, explore_every=4))
    verify = VerifyThread(client, target, local=drafting)
    try:
        for index, prompt in enumerate(PROMPTS):
            start_local(client, spec_of(f"arms-{index}", prompt, max_new_tokens=40))
        for index, prompt in enumerate(PROMPTS):
            wait_finished(client, f"arms-{index}")
            assert output_tokens(client, f"arms-{index}") == reference(target, prompt, 40)
        verify.worker.heartbeat(5.0)
    finally:
        verify.close()
    measured = drafting.turns.to_dict()
    assert any(set(arms) == {"draft", "plain"} for arms in measured.values()), measured
    beat = Heartbeat.decode(client.get(heartbeat_key("verify-t")))
    assert beat.local_turns == measured and beat.local_draft == "tiny-draft"


def as_local(drafter, committed: list[int], tokens_left: int = 100) -> SimpleNamespace:
    """What LocalDrafting.warm reads of a session: its draft half's drafter, committed context and how many
    tokens it may still produce."""
    return SimpleNamespace(local=SimpleNamespace(drafter=drafter, committed=committed, num_output=0,
                                                 spec=SimpleNamespace(max_new_tokens=tokens_left),
                                                 opening_next=False))


def test_lagging_drafts_catch_up_within_a_turns_budget_and_decode_plain_meanwhile(draft):
    """A draft that lags its session by more than a block (a new prompt; tokens plain turns committed) is
    caught up a budget of tokens per turn, in order, and its session is named to decode plain until then; a
    draft that lags by a block or less is left to the draft call; a session too close to its end for the
    catch-up to pay back decodes plain, its draft left cold."""
    drafting = LocalDrafting(draft, SpeculativeSettings(), warm_tokens=20)
    cold_long = as_local(draft.new_drafter(), list(range(1, 31)))
    cold_short = as_local(draft.new_drafter(), [5, 9, 13, 2, 40, 41])
    synced = as_local(draft.new_drafter(), [3, 3, 8, 60])
    synced.local.drafter.propose(synced.local.committed, 2, SamplingParams(), None)
    synced.local.committed += [7, 8]
    held = synced.local.drafter.sequence.length
    ending = as_local(draft.new_drafter(), list(range(40, 80)), tokens_left=39 // WARM_PAYBACK - 1)
    sessions = [ending, cold_long, cold_short, synced]
    assert drafting.warm(sessions, cap=2) == {id(ending), id(cold_long), id(cold_short)}
    assert cold_long.local.drafter.missing(cold_long.local.committed) == 29 - 20
    assert cold_short.local.drafter.missing(cold_short.local.committed) == 5
    assert drafting.warm(sessions, cap=2) == {id(ending)}
    assert ending.local.drafter.sequence.length == 0
    assert cold_long.local.drafter.missing(cold_long.local.committed) == 0
    assert cold_short.local.drafter.missing(cold_short.local.committed) == 0
    assert synced.local.drafter.sequence.length == held  # not warmed: its draft call feeds the last tokens


def test_a_session_whose_next_block_is_its_opening_is_caught_up_after_it(draft):
    """The target-only opening goes first, its draft's prefill after it: a catch-up before would hold up the
    first token."""
    drafting = LocalDrafting(draft, SpeculativeSettings(), warm_tokens=20)
    opening = as_local(draft.new_drafter(), list(range(1, 31)))
    opening.local.opening_next = True
    assert drafting.warm([opening], cap=2) == set()
    assert opening.local.drafter.sequence.length == 0
    opening.local.opening_next = False
    assert drafting.warm([opening], cap=2) == {id(opening)}
    assert opening.local.drafter.missing(opening.local.committed) == 29 - 20


def test_while_no_acceptance_is_known_one_session_at_a_time_explores_drafting(draft):
    """Before the first rounds measured the acceptance, a turn of many sessions lets one explore drafting, the one
    whose draft lags least and whose next block is not its opening; a lone stream, or a known acceptance, leaves
    each session's controller to decide, as does prompt lookup (nothing to catch up, nothing to pay)."""
    cost = CostModel({1: 10.0, 5: 12.0}, draft_ms_per_token=1.0, pipelined=False)
    drafting = LocalDrafting(draft, SpeculativeSettings(), cost=cost)
    cold = as_local(draft.new_drafter(), list(range(1, 31)))
    warmer = as_local(draft.new_drafter(), list(range(1, 31)))
    warmer.local.drafter.draft_engine.prefill_many([(warmer.local.drafter, warmer.local.committed)], 20)
    opening = as_local(draft.new_drafter(), [4, 5])
    opening.local.opening_next = True
    assert drafting._explorer([cold, warmer, opening], rows=3) is warmer
    assert drafting._explorer([cold, opening], rows=2) is cold
    assert drafting._explorer([opening], rows=2) is None
    assert drafting._explorer([cold, warmer], rows=1) is None
    lookup = LocalDrafting(DraftSource("ngram", None), SpeculativeSettings(), cost=cost)
    assert lookup._explorer([as_local(lookup.source.new_drafter(), [1, 2]), cold], rows=2) is None
    for _ in range(drafting.recent.min_rounds):
        drafting.recent.observe(4, 3, rows=2)
    drafting.batch_gamma(2)  # the turn reads the acceptance
    assert drafting._explorer([cold, warmer], rows=2) is None


def test_before_the_acceptance_is_known_a_load_where_drafting_could_not_pay_decodes_plain(draft):
    """No acceptance measured yet: where even a draft at its best (EXPLORE_ALPHA) would gain less than EXPLORE_GAIN
    at this load, every session decodes plain this turn (nothing to learn there, and an explorer would hold every
    row up); where it could gain, a session explores (None: _explorer picks it); a lone stream explores itself."""
    # a step of 2 rows costs about what one row does; one of 8 rows costs in proportion to its tokens
    cost = CostModel({1: 10.0, 5: 12.0}, draft_ms_per_token=1.0, pipelined=False,
                     step_ms={2: {1: 11.0, 5: 14.0}, 8: {1: 20.0, 2: 40.0, 9: 180.0}})
    drafting = LocalDrafting(draft, SpeculativeSettings(), cost=cost)
    assert best_block_length(EXPLORE_ALPHA, cost, range(1, 9), 6, 6)[1] < EXPLORE_GAIN
    assert drafting.batch_gamma(8) == 0 and drafting.batch_gamma(6) == 0
    assert drafting.batch_gamma(2) is None and drafting.batch_gamma(1) is None


def test_a_turn_is_measured_without_its_catch_up_and_an_unmeasured_turns_arm_runs_again(draft):
    """A turn that also prefilled a prompt is not measured (both arms pay for prompts alike), nor one that left
    too many sessions plain while their drafts caught up; its arm (a trial, maybe) runs again at that load, at
    most MAX_CARRIED_TURNS times in a row, then the choice is made again from what was measured. A measured
    turn's figure leaves the catch-up out."""
    recent = RecentRounds()
    for _ in range(60):
        recent.observe(4, 3, rows=1)
    cost = CostModel({1: 10.0, 5: 12.0}, draft_ms_per_token=1.0, pipelined=False)
    drafting = LocalDrafting(draft, SpeculativeSettings(), cost=cost, recent=recent,
                             turns=MeasuredTurns(min_turns=1))
    chosen = []
    choose = drafting.turns.choose
    drafting.turns.choose = lambda *args, **kwargs: chosen.append(choose(*args, **kwargs)) or chosen[-1]
    first = drafting.batch_gamma(1)
    for _ in range(MAX_CARRIED_TURNS):
        drafting.settle(None, 1.0)  # a prompt was prefilled in that turn
        assert drafting.batch_gamma(1) == first and len(chosen) == 1
    drafting._held = True  # a drafting turn whose sessions mostly waited for their drafts
    drafting.settle(4, 1.0)
    drafting.batch_gamma(1)
    assert len(chosen) == 2
    drafting._warm_s = 0.25
    drafting.settle(6, 0.75)
    figures = drafting.turns.figures(1, chosen[1])
    assert figures.turns == 1 and figures.seconds == pytest.approx(0.5) and figures.tokens == 6


def test_what_a_drafting_turn_measures_goes_by_how_many_sessions_drafted_a_full_block(draft):
    """No session drafted (drafts catching up, fallbacks, ends of output): a plain turn. More than a quarter
    without a full block: not measured. Otherwise: a drafting turn."""
    drafting = LocalDrafting(draft, SpeculativeSettings())
    drafting._turn = (1, DRAFT)
    drafting._classify(1, 0, drafted=False)
    assert drafting._turn == (1, PLAIN) and not drafting._held
    drafting._turn = (8, DRAFT)
    drafting._classify(8, 6, drafted=True)
    assert drafting._turn == (8, DRAFT) and not drafting._held
    drafting._classify(8, 5, drafted=True)
    assert drafting._held


def test_the_catch_up_feeds_the_prefill_rate_drafting_is_charged_with(draft):
    drafting = LocalDrafting(draft, SpeculativeSettings(), warm_tokens=20)
    drafting.warm([as_local(draft.new_drafter(), list(range(1, 31)))], cap=2)
    assert drafting.prefill_cost.tokens == 20 and drafting.prefill_cost.seconds > 0
