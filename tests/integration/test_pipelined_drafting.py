"""Pipelined drafting against a real Redis and a verify worker thread, on tiny models: the output is
target-only decoding's, token for token, and speculated blocks really get used."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from draft_worker import driver as driver_module
from services.config import SchedulerSettings
from services.models.drafters import DraftSource
from services.protocol import SessionSpec, cancel_key, output_stream
from services.speculative.params import SamplingParams
from tests.conftest import build_tiny_llama, perturbed_copy
from tests.integration.fleet import VerifyThread, behind_link, draft_runtime, output_tokens, reference, submit_spec

PROMPT = [5, 9, 13, 2, 40, 41, 7, 7, 30, 12, 5, 9, 13]


@pytest.fixture(scope="module")
def target():
    return build_tiny_llama(0)


@pytest.fixture
def fleet(target, redis_url):
    """Without the verify worker's word on its load (worker.load_word): these tests count speculations and rounds,
    which the word moves by what the steps measured (test_verify_worker and test_load_word test it)."""
    client = redis.Redis.from_url(redis_url)
    verify = VerifyThread(client, target, load_word=False)
    yield client
    verify.close()


def drive(client, draft_source: DraftSource, *, pipelined: bool, request_id: str, max_new_tokens: int,
          temperature: float = 0.0, seed: int | None = None, block_policy: str = "acceptance", blocks_ahead: int = 0,
          draft_client=None, **speculative):
    runtime = draft_runtime(draft_client or client, draft_source, pipelined=pipelined, block_policy=block_policy,
                            blocks_ahead=blocks_ahead, **speculative)
    spec = SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True,
                       sampling=SamplingParams(temperature=temperature, seed=seed))
    submit_spec(client, spec)
    try:
        summary = runtime.driver.drive(runtime.new_session(spec, []))
    finally:
        runtime.close()
    return output_tokens(client, request_id), summary, runtime


@pytest.mark.parametrize("draft", ["model", "ngram"])
def test_pipelined_output_equals_target_only(fleet, target, draft):
    source = (DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1)) if draft == "model"
              else DraftSource("ngram", None))
    expected = reference(target, PROMPT, 40)
    tokens, summary, _ = drive(fleet, source, pipelined=True, request_id=f"p-{draft}", max_new_tokens=40)
    assert tokens == expected
    timing = summary.timing
    assert timing.speculations > 0 and timing.speculation_hits <= timing.speculations
    if draft == "model":  # a close draft: whole blocks accepted, speculations used
        assert timing.speculation_hits > 0
    assert timing.hidden_s <= timing.speculation_s
    plain_tokens, plain, _ = drive(fleet, source, pipelined=False, request_id=f"s-{draft}", max_new_tokens=40)
    assert plain_tokens == expected
    assert plain.timing.speculations == 0 and plain.timing.hidden_s == 0
    # a used speculation replaces a round's critical-path drafting
    assert plain.timing.draft_s > 0 and summary.rounds >= 1


def test_sampled_sessions_are_reproducible_by_seed_pipelined_or_not(fleet, target):
    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    runs = [drive(fleet, source, pipelined=True, request_id=f"t-{n}", max_new_tokens=30, temperature=1.0, seed=7)
            for n in range(2)]
    assert runs[0][0] == runs[1][0] and len(runs[0][0]) == 30
    assert runs[0][1].timing.speculations > 0
    # each round drafts from its own seeded stream: pipelining (and when verdicts arrive) changes nothing
    plain, _, _ = drive(fleet, source, pipelined=False, request_id="t-plain", max_new_tokens=30, temperature=1.0,
                        seed=7)
    assert plain == runs[0][0]


@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 11)])
def test_blocks_verified_ahead_change_nothing_in_the_output(fleet, target, temperature, seed):
    """One block at a time, or up to three out, each chained to the one before, the draft behind a 60 ms link
    (its speculation is done before a verdict comes back, as at the edge): the same tokens, greedy or seeded,
    with a perturbed draft whose chains hold or break as it guesses (test_verify_worker breaks one on purpose)."""
    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    with behind_link(fleet, 60) as linked:
        runs = {depth: drive(fleet, source, pipelined=True, request_id=f"ahead-{temperature}-{depth}",
                             max_new_tokens=48, temperature=temperature, seed=seed, blocks_ahead=depth,
                             draft_client=linked) for depth in (1, 3)}
    assert runs[1][0] == runs[3][0] and len(runs[3][0]) == 48
    assert runs[1][1].timing.chained_rounds == 0
    assert runs[3][1].rounds == runs[1][1].rounds  # the same rounds: only when each was verified moved
    if temperature == 0.0:
        assert runs[3][0] == reference(target, PROMPT, 48)


def test_a_draft_that_is_always_right_has_its_rounds_verified_ahead(fleet, target):
    """The target as its own draft behind a 60 ms link, greedy: every block is accepted whole and every guess
    of the bonus token is right, so each chained block is taken at once and most rounds are verified ahead."""
    source = DraftSource("tiny-self", target)
    with behind_link(fleet, 60) as linked:
        tokens, summary, runtime = drive(fleet, source, pipelined=True, request_id="ahead-exact",
                                         max_new_tokens=48, blocks_ahead=2, draft_client=linked)
    assert tokens == reference(target, PROMPT, 48)
    assert summary.timing.chained_rounds > 0 and summary.timing.chains_broken == 0, summary.timing
    # what the auto depth counts besides the trip: the drafting of a block, as the driver timed it
    driver = runtime.driver
    assert driver._draft_step_ms > 0 and driver._verify_ms > 0


def test_cost_policy_reads_the_pools_verify_curve(fleet, target):
    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    tokens, _, runtime = drive(fleet, source, pipelined=True, request_id="cost", max_new_tokens=30,
                               block_policy="cost")
    assert tokens == reference(target, PROMPT, 30)
    cost = runtime.cost_model("cpu")
    assert cost.verify_ms == {1: 10.0, 4: 11.0, 9: 12.0} and cost.draft_ms_per_token == 0.5
    assert runtime.cost_model("gpu") is None  # no verify worker there


def test_model_draft_cache_survives_a_missed_speculation(target):
    """Speculating past a block, then drafting from a shorter committed context, gives what a fresh
    drafter gives: the model draft's cache crops back correctly."""
    from services.engine.draft_pipeline import speculate

    draft_model = perturbed_copy(target, scale=0.3, seed=2)
    used, fresh = DraftSource("d", draft_model).new_drafter(), DraftSource("d", draft_model).new_drafter()
    greedy = SamplingParams()
    block = used.propose(PROMPT, 4, greedy, None).token_ids
    speculation = speculate(used, PROMPT, block, 3, greedy, None)
    assert speculation is not None and len(speculation.draft_ids) == 3
    committed = [*PROMPT, block[0], (block[1] + 1) % target.vocab_size]  # a rejection at position 2
    assert used.propose(committed, 4, greedy, None).token_ids == fresh.propose(committed, 4, greedy, None).token_ids


def test_a_long_prompt_opens_with_a_target_only_round_while_the_draft_prefills(fleet, target):
    """The draft's prefill overlaps the target's: the first block is the target's own round, the draft
    speculates the block after it (its bonus-token guess), and the output is target-only decoding's."""
    from services.redis_client import read_events

    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    expected = reference(target, PROMPT, 30)
    tokens, summary, _ = drive(fleet, source, pipelined=True, request_id="opening", max_new_tokens=30,
                               plain_opening_tokens=len(PROMPT))
    assert tokens == expected
    events = read_events(fleet, "opening")
    assert len(events[0].token_ids) == 1 and events[0].stats.num_draft_tokens == 0  # the target's round alone
    assert summary.timing.speculations > 0 and summary.timing.speculation_hits > 0
    assert events[1].stats.num_draft_tokens > 0  # then drafted blocks
    drafted_first, _, _ = drive(fleet, source, pipelined=True, request_id="drafted-opening", max_new_tokens=30,
                                plain_opening_tokens=len(PROMPT) + 1)  # a prompt shorter than the threshold
    assert drafted_first == expected
    assert read_events(fleet, "drafted-opening")[0].stats.num_draft_tokens > 0


def test_cold_sessions_warm_up_a_budget_per_turn_then_speculate_as_alone(target):
    """A burst of new sessions prefills a piece per driver turn (verdicts are never held up by a whole batch of
    prompts), and what they then speculate is what a drafter that was never cold drafts."""
    from services.engine.draft_pipeline import SpeculationState, speculate_many, warm_up

    greedy = SamplingParams()
    source = DraftSource("d", perturbed_copy(target, scale=0.3, seed=2))
    contexts = [[(7 * k + index) % target.vocab_size for k in range(30 + 5 * index)] for index in range(3)]
    states = [SpeculationState(source.new_drafter(), context, 3, greedy, None) for context in contexts]
    missing = sum(len(context) - 1 for context in contexts)  # 102 prompt tokens to prefill, 16 a turn
    turns = 0
    while len(warm_up(states, budget=16)) < len(states):
        turns += 1
        assert sum(state.drafter.sequence.length for state in states) == min(16 * turns, missing)
    assert turns == -(-missing // 16)
    speculate_many(states)
    for state, context in zip(states, contexts):
        alone = source.new_drafter().propose(context, 4, greedy, None).token_ids
        assert [state.tokens[0], *state.tokens[1:]] == alone


def test_a_session_whose_link_makes_drafting_lose_goes_plain_and_says_so(fleet, target):
    """The draft worker's measured transport enters the cost model of its new sessions: with rounds costing
    400 ms over the link (fed to its meter as measured rounds), drafting loses to the verify worker's own
    target-only rounds, and the session says why; the output is target-only decoding's all the same."""
    from services.link.meter import RoundTrip

    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    runtime = draft_runtime(fleet, source, pipelined=True, block_policy="cost", blocks_ahead=1)
    for _ in range(5):
        runtime.driver.meter.observe_round(RoundTrip(round_trip_ms=410.0, transport_ms=400.0, verify_ms=10.0))
    spec = SessionSpec(request_id="slow-link", prompt_ids=PROMPT, max_new_tokens=24, ignore_eos=True)
    submit_spec(fleet, spec)
    try:
        session = runtime.new_session(spec, [])
        assert session.controller.cost.link_ms == 400.0
        summary = runtime.driver.drive(session)
    finally:
        runtime.close()
    assert summary.plain_reason == "link" and summary.to_dict()["plain_reason"] == "link"
    # probes of one token until the acceptance window is long enough to decide (fallback_min_rounds), then
    # target-only rounds
    assert summary.stats.num_drafts <= 5 and summary.stats.num_draft_tokens == summary.stats.num_drafts
    assert summary.stats.num_target_calls > summary.stats.num_drafts + 5
    assert output_tokens(fleet, "slow-link") == reference(target, PROMPT, 24)


def test_a_cancellation_is_seen_while_rounds_come_faster_than_the_control_look(fleet, target, monkeypatch):
    """A tiny target's rounds take milliseconds, so blocks go out far more often than the driver's control
    look (CONTROL_EVERY_S): the look must still ride with them now and then (a block sent without it is no
    look), or a cancelled session runs to its end. The target drafts for itself: always right, so the
    session never goes target-only (where the verify worker would see the cancellation itself). The look
    comes every 20 ms here, still several rounds apart: at 200 ms a fast machine ends the whole session
    between two looks."""
    monkeypatch.setattr(driver_module, "CONTROL_EVERY_S", 0.02)
    runtime = draft_runtime(fleet, DraftSource("tiny-self", target), pipelined=True)
    spec = SessionSpec(request_id="cancel-me", prompt_ids=PROMPT, max_new_tokens=240, ignore_eos=True)
    submit_spec(fleet, spec)

    def cancel_once_under_way() -> None:
        while fleet.xlen(output_stream("cancel-me")) < 3:
            time.sleep(0.001)
        fleet.set(cancel_key("cancel-me"), b"1")

    canceller = threading.Thread(target=cancel_once_under_way)
    canceller.start()
    try:
        summary = runtime.driver.drive(runtime.new_session(spec, []))
    finally:
        runtime.close()
        canceller.join(timeout=10)
    assert summary.finish_reason == "cancelled" and summary.num_output_tokens < 240, summary


def _speculated_after_round_0(runtime) -> bool:
    """The driver holds the session and has drafted the block after its round 0 (read, not changed)."""
    try:
        handles = list(runtime.driver._handles.values())
    except RuntimeError:  # the driver took a session in as this read it
        return False
    flight = handles[0].session.in_flight if handles else None
    return flight is not None and flight.speculating is not None and flight.speculating.done


@pytest.mark.parametrize("draft_first", [True, False])
def test_a_session_the_gateway_opened_takes_its_round_0_as_its_first_block(fleet, target, draft_first):
    """SessionSpec.opened: round 0 went to the verify pool from the gateway. Its first token needs no draft
    worker; the draft session takes that round as its first block out, whether it starts before the verdict
    (which then reaches it through the request's own verdict list) or after (it resumes from round 1)."""
    from draft_worker.runtime import drive_session
    from services.protocol import opening_block, verdict_queue, verify_pool_queue
    from services.redis_client import read_events

    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    expected = reference(target, PROMPT, 30)
    request_id = f"opened-{draft_first}"
    spec = SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=30, ignore_eos=True, opened=True)
    submit_spec(fleet, spec)
    runtime = draft_runtime(fleet, source, pipelined=True)
    result = {}
    try:
        if draft_first:  # the draft session waits on round 0 before the verify worker has it
            driving = threading.Thread(target=lambda: result.update(drive_session(runtime, request_id)))
            driving.start()
            deadline = time.monotonic() + 30
            while not _speculated_after_round_0(runtime):  # a slow box may still be prefilling the draft
                assert time.monotonic() < deadline
                time.sleep(0.01)
            fleet.rpush(verify_pool_queue(spec.pool), opening_block(spec).encode())
            driving.join(60)
        else:  # the first token before any draft worker started
            fleet.rpush(verify_pool_queue(spec.pool), opening_block(spec).encode())
            deadline = time.monotonic() + 30
            while not read_events(fleet, request_id):
                assert time.monotonic() < deadline
                time.sleep(0.01)
            result.update(drive_session(runtime, request_id))
    finally:
        runtime.close()
    assert output_tokens(fleet, request_id) == expected
    events = read_events(fleet, request_id)
    assert len(events[0].token_ids) == 1 and events[0].stats.num_draft_tokens == 0  # the target's round alone
    assert events[-1].stats.num_draft_tokens > 0 and result["finish_reason"] == "length"
    # its BlockTaken note and verdict: moved to the inbox, or left unread (the session resumed from the stream)
    assert (fleet.llen(verdict_queue(request_id)) == 0) is draft_first
    if draft_first:  # drafted while the target prefilled: the speculation after round 0 was used
        assert result["speculation_hits"] > 0


@pytest.mark.parametrize("route", ["sd", "ar"])
def test_the_driver_waits_on_its_inbox_while_an_opened_sessions_round_0_is_out(target, redis_url, route):
    """A session the gateway opened has its first block out from the start. While round 0 is verified (a long
    prompt's prefill, seconds on a CPU) the driver has nothing to send once block 1 is speculated: it must wait
    on its inbox, not spin on a core that the verify worker and the gateway share with it on one box."""
    from draft_worker.runtime import drive_session

    client = redis.Redis.from_url(redis_url)
    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    request_id = f"opened-quiet-{route}"
    spec = SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=30, ignore_eos=True, opened=True,
                       route=route)
    submit_spec(client, spec)  # round 0 is never verified here: its verdict does not come
    runtime = draft_runtime(client, source, pipelined=True)
    driving = threading.Thread(target=lambda: drive_session(runtime, request_id), daemon=True)
    try:
        driving.start()
        deadline = time.monotonic() + 30
        while runtime.driver.num_sessions == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.5)  # block 1's speculation (a tiny draft) is done by now
        turns, since = runtime.driver.num_turns, time.monotonic()
        time.sleep(1.0)
        # woken by the control look (every CONTROL_EVERY_S) and the outbox, not turning in a loop: per second
        # slept as it was (a loaded box oversleeps)
        turned, slept = runtime.driver.num_turns - turns, time.monotonic() - since
        assert turned <= 4 * slept / driver_module.CONTROL_EVERY_S, (turned, slept)
        client.set(cancel_key(request_id), 1)
        driving.join(30)
        assert not driving.is_alive()
    finally:
        runtime.close()


def test_a_verify_worker_that_bridges_while_blocks_cross_the_link_commits_target_only_output(target, redis_url):
    """Between a verdict and the next block (60 ms of link away) the verify worker decodes the session itself,
    then checks the block against those tokens: greedy output is target-only decoding's, chained blocks
    included, and seeded sampling (which does not bridge) draws the same tokens as without a link."""
    client = redis.Redis.from_url(redis_url)
    # a target step that costs more than a tiny draft block, as with a real pair
    verify = VerifyThread(client, target, scheduler=SchedulerSettings(bridge=True), step_s=0.04)
    try:
        source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
        with behind_link(client, 60) as linked:
            tokens, _, _ = drive(client, source, pipelined=True, request_id="bridged", max_new_tokens=48,
                                 blocks_ahead=3, draft_client=linked)
            sampled, _, _ = drive(client, source, pipelined=True, request_id="bridged-seeded", max_new_tokens=24,
                                  temperature=1.0, seed=7, draft_client=linked)
        counters = verify.worker.figures.counters
        assert tokens == reference(target, PROMPT, 48)
        assert counters.bridged_rounds > 0 and counters.blocks_bridged > 0
        nearby, _, _ = drive(client, source, pipelined=True, request_id="nearby-seeded", max_new_tokens=24,
                             temperature=1.0, seed=7)
        assert sampled == nearby
    finally:
        verify.close()


def test_a_draft_that_prefills_after_the_opening_waits_for_its_verdict_unless_another_session_keeps_it_busy(
        target, redis_url):
    """speculative.draft_prefill "after_opening": alone, a session in its opening round is not prefilled (the
    verify worker has every core for the opening's prefill); beside a session with a drafted block out (the verify
    worker on its own cores then) it is, as with "overlap"."""
    from draft_worker.runtime import drive_session

    client = redis.Redis.from_url(redis_url)
    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    runtime = draft_runtime(client, source, pipelined=True, draft_prefill="after_opening", plain_opening_tokens=0)
    opened = SessionSpec(request_id="after-opening", prompt_ids=PROMPT, max_new_tokens=30, ignore_eos=True,
                         opened=True)  # its round 0 is never verified here
    drafted = SessionSpec(request_id="drafted-beside", prompt_ids=PROMPT[:9], max_new_tokens=30, ignore_eos=True)
    threads = []

    def start(spec: SessionSpec):
        submit_spec(client, spec)
        threads.append(threading.Thread(target=lambda: drive_session(runtime, spec.request_id), daemon=True))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while spec.request_id not in runtime.driver._handles:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        return runtime.driver._handles[spec.request_id].session

    try:
        session = start(opened)
        time.sleep(0.5)
        assert session.in_opening and session.timing.speculations == 0
        assert session.drafter.missing(PROMPT) == len(PROMPT) - 1  # nothing prefilled
        start(drafted)  # its first block goes out drafted (plain_opening_tokens 0) and stays out
        deadline = time.monotonic() + 30
        while not (session.in_flight.speculating and session.in_flight.speculating.done):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert session.in_opening and session.drafter.missing(PROMPT) == 0
        for spec in (opened, drafted):
            client.set(cancel_key(spec.request_id), 1)
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive()
    finally:
        runtime.close()


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (1.0, 5)])
def test_a_draft_prefilled_after_the_opening_changes_nothing_in_the_output(target, redis_url, temperature, seed,
                                                                           monkeypatch):
    """Greedy: target-only decoding's tokens, the rounds after the opening bridged while the draft prefills (a
    slow one here), which the draft then takes from the stream before drafting its first block. Seeded sampling
    (which does not bridge): the tokens of "overlap"."""
    prefill = driver_module.prefill
    monkeypatch.setattr(driver_module, "prefill", lambda items: (time.sleep(0.15), prefill(items)))
    client = redis.Redis.from_url(redis_url)
    source = DraftSource("tiny-draft", perturbed_copy(target, scale=0.05, seed=1))
    results, bridged = {}, {}
    for mode in ("overlap", "after_opening"):
        verify = VerifyThread(client, target, step_s=0.02, draft_after_opening=mode == "after_opening")
        try:
            results[mode] = drive(client, source, pipelined=True, request_id=f"{mode}-{temperature}",
                                  max_new_tokens=40, temperature=temperature, seed=seed,
                                  plain_opening_tokens=len(PROMPT), draft_prefill=mode)
        finally:
            verify.close()
        bridged[mode] = verify.worker.figures.counters.bridged_rounds
    (overlap, _, _), (after, summary, _) = results["overlap"], results["after_opening"]
    assert after == overlap and bridged["overlap"] == 0
    if seed is None:
        assert after == reference(target, PROMPT, 40)
        assert summary.stats.num_draft_tokens > 0 and bridged["after_opening"] > 0
        assert summary.timing.caught_up_rounds > 0
    else:
        assert bridged["after_opening"] == 0 and summary.timing.caught_up_rounds == 0
