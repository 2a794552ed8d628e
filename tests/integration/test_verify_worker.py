"""The verify worker's intake against a real Redis, turn by turn: stale and duplicate blocks, bad blocks, and
a draft driver that loses Redis for a moment."""

from __future__ import annotations

import time

import pytest
import redis
import torch

from services.models.drafters import DraftSource
from services.models.drafters.base import block_probs
from services.models.engine import TorchEngine
from services.protocol import DraftBlock, OutputEvent, SessionSpec, Verdict, output_stream, verify_pool_queue
from services.config import SchedulerSettings
from services.redis_client import read_events
from services.speculative.block_length import WORD_PLAIN_ROUNDS
from services.speculative.measured_turns import load_bucket
from services.speculative.params import SamplingParams
from tests.conftest import build_tiny_llama
from tests.integration.fleet import empty_redis, output_tokens, running_fleet, submit_spec
from verify_worker.worker import VerifyWorker

PROMPT = [5, 9, 13, 2, 40, 41, 7, 7, 30, 12]
REPLY = "test:inbox"


@pytest.fixture
def client():
    with empty_redis() as connection:
        yield connection


@pytest.fixture
def worker(client):
    return VerifyWorker(client=client, engine=TorchEngine(build_tiny_llama(0)), worker_id="verify-w", pool="cpu")


@pytest.fixture
def bridging(client):
    """A worker that bridges (scheduler.bridge): it decodes a session on its own between a verdict and the
    next block."""
    return VerifyWorker(client=client, engine=TorchEngine(build_tiny_llama(0)), worker_id="verify-w", pool="cpu",
                        scheduler=SchedulerSettings(bridge=True))


def block(round_index: int, num_committed: int, draft_ids=(), **fields) -> DraftBlock:
    return DraftBlock(request_id="r", round=round_index, num_committed=num_committed, draft_ids=list(draft_ids),
                      reply_to=REPLY, **fields)


def verdicts(client) -> list[Verdict]:
    return [Verdict.decode(raw) for raw in client.lrange(REPLY, 0, -1) if b"verdict" in raw]


def test_a_stale_block_is_answered_from_the_stream_and_the_block_in_hand_survives(client, worker):
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT)).encode())
    while not verdicts(client):
        worker.turn(0.1)
    first = verdicts(client)[0]
    session = worker.sessions.get("r")
    assert session.round == 1 and not session.has_work
    # the next block, then a resend of round 0 (a draft side that thought this worker dead)
    worker._admit([(block(1, first.num_committed, [3, 4]).encode(), False), (block(0, len(PROMPT)).encode(), True)])
    assert worker.sessions.get("r") is session and session.block.round == 1  # the block in hand stays
    resync = [v for v in verdicts(client) if v.round == 0][-1]
    assert resync.committed_ids == first.committed_ids and resync.num_rounds == 1
    worker._admit([(block(1, first.num_committed, [3, 4]).encode(), False)])  # a duplicate of the block in hand
    assert worker.sessions.get("r") is session and session.target.draft_ids == [3, 4]
    while not any(v.round == 1 for v in verdicts(client)):
        worker.turn(0.1)
    assert [event.seq for event in read_events(client, "r")] == [0, 1]


def test_a_bad_block_fails_its_request_and_the_worker_goes_on(client, worker):
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True))
    bad = block(0, len(PROMPT), [3, 4], draft_probs=b"\x00" * 6, vocab_size=96)  # 6 bytes, not 2 x 96 x 2
    client.rpush(verify_pool_queue("cpu"), bad.encode())
    worker.turn(0.1)
    worker.turn(0.1)
    events = read_events(client, "r")
    assert events[-1].finished and events[-1].finish_reason == "error" and "draft_probs" in events[-1].error
    assert "r" not in worker.sessions


def test_draft_probs_stay_on_their_tokens_when_a_block_mixes_lookup_and_model():
    model_row = torch.softmax(torch.randn(5), dim=0)
    probs = block_probs([None, model_row, None], [2, 4, 1])  # lookup, model, lookup
    assert probs.shape == (3, 5) and probs[0, 2] == 1.0 and probs[0].sum() == 1.0
    assert torch.equal(probs[1], model_row) and probs[2, 1] == 1.0
    assert block_probs([None, None], [1, 2]) is None


def test_the_driver_sends_its_blocks_again_after_a_failed_push(client):
    target = build_tiny_llama(0)
    with running_fleet(client, target, DraftSource("ngram", None)) as (_, runtime):
        driver = runtime.driver
        execute = driver.outbox._execute
        failures = []

        def flaky_execute(jobs):  # the push never reached Redis
            if any(job.pushes for job in jobs) and not failures:
                failures.append(sum(len(job.pushes) for job in jobs))
                raise redis.ConnectionError("Redis went away for a moment")
            return execute(jobs)

        driver.outbox._execute = flaky_execute
        spec = SessionSpec(request_id="flaky", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True)
        submit_spec(client, spec)
        summary = driver.drive(runtime.new_session(spec, []), every_s=0.5)
    assert failures and summary.finish_reason == "length"
    events = [OutputEvent.decode(fields[b"m"]) for _, fields in client.xrange(output_stream("flaky"))]
    assert [event.seq for event in events] == list(range(len(events)))
    assert len(output_tokens(client, "flaky")) == 20


def greedy(worker, count: int, prompt_ids: list[int] = PROMPT) -> list[int]:
    from services.engine import GenerationOptions, GenerationSession

    session = GenerationSession(worker.target, None, prompt_ids, GenerationOptions(max_new_tokens=count,
                                                                                   ignore_eos=True))
    while not session.finished:
        session.step()
    return list(session.output_ids)


def chained(parent: DraftBlock, block_id: int, bonus: int, draft_ids) -> DraftBlock:
    """A block sent ahead of `parent`'s verdict, assuming it accepted whole with `bonus` after it."""
    return block(parent.round + 1, parent.num_committed + len(parent.draft_ids) + 1, draft_ids, block_id=block_id,
                 parent_id=parent.block_id, assumed_bonus=bonus)


def test_a_chain_goes_on_while_it_holds_and_drops_after_a_rejection_in_its_middle(client, worker):
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True))
    out = greedy(worker, 20)
    first = block(0, len(PROMPT), out[0:3], block_id=1)
    second = chained(first, 2, out[3], out[4:6])  # holds: the target's own tokens
    third = chained(second, 3, out[6], [out[7], (out[8] + 1) % 96, out[9]])  # holds, then a rejection inside
    fourth = chained(third, 4, out[10], out[11:13])  # assumed the third accepted whole: dropped
    client.rpush(verify_pool_queue("cpu"), *(b.encode() for b in (first, second, third, fourth)))
    while len(verdicts(client)) < 3:
        worker.turn(0.1)
    for _ in range(3):
        worker.turn(0.05)
    got = verdicts(client)
    assert [(v.round, v.block_id) for v in got] == [(0, 1), (1, 2), (2, 3)]  # nothing for the fourth
    assert [v.num_accepted for v in got] == [3, 2, 1]
    assert output_tokens(client, "r") == out[:9]  # accepted, bonus, accepted..., the target's token at the rejection
    session = worker.sessions.get("r")
    assert not session.has_work and session.parked == [] and session.round == 3
    # the draft side went on from the third verdict: a fresh block for round 3 is taken as usual
    client.rpush(verify_pool_queue("cpu"), block(3, len(PROMPT) + 9, out[9:11], block_id=5).encode())
    while len(verdicts(client)) < 4:
        worker.turn(0.1)
    assert verdicts(client)[-1].block_id == 5 and output_tokens(client, "r") == out[:12]


def test_a_chained_block_arriving_after_its_parents_verdict_is_checked_on_it(client, worker):
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True))
    out = greedy(worker, 20)
    first = block(0, len(PROMPT), out[0:2], block_id=1)
    client.rpush(verify_pool_queue("cpu"), first.encode())
    while not verdicts(client):
        worker.turn(0.1)
    wrong_guess = chained(first, 2, (out[2] + 1) % 96, out[3:5])
    worker._admit([(wrong_guess.encode(), False)])
    assert not worker.sessions.get("r").has_work  # its bonus guess was not the target's: dropped
    right_guess = chained(first, 3, out[2], out[3:5])
    worker._admit([(right_guess.encode(), False)])
    assert worker.sessions.get("r").block.block_id == 3
    while len(verdicts(client)) < 2:
        worker.turn(0.1)
    assert verdicts(client)[-1].num_accepted == 2 and output_tokens(client, "r") == out[:6]


def lose_last_events(client, count: int) -> None:
    """What a failover's new primary lacks: the last `count` events of the stream."""
    for entry_id, _ in client.xrevrange(output_stream("r"), count=count):
        client.xdel(output_stream("r"), entry_id)


def run_rounds(client, worker, rounds: int) -> list[Verdict]:
    for index in range(rounds):
        committed = verdicts(client)[-1].num_committed if index else len(PROMPT)
        client.rpush(verify_pool_queue("cpu"), block(index, committed).encode())
        while len(verdicts(client)) <= index:
            worker.turn(0.1)
    return verdicts(client)


def test_a_stream_that_lost_its_last_events_is_made_whole_by_the_next_commit(client, worker):
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True))
    run_rounds(client, worker, 3)
    before = client.xrange(output_stream("r"))
    lose_last_events(client, 2)
    client.rpush(verify_pool_queue("cpu"), block(3, verdicts(client)[-1].num_committed).encode())
    while len(verdicts(client)) < 4:
        worker.turn(0.1)
    after = client.xrange(output_stream("r"))
    assert [fields for _, fields in after[:3]] == [fields for _, fields in before]  # the same events again
    seqs = [event.seq for event in read_events(client, "r")]
    # each round once, in order (a bridged round may follow while the next block is on its way: the commit's
    # replies are read after the next forward)
    assert seqs[:4] == [0, 1, 2, 3] and seqs == list(range(len(seqs)))
    assert verdicts(client)[3].round == 3 and worker.sessions.get("r") is not None


def test_after_an_outage_the_worker_refills_streams_of_sessions_between_rounds_and_finished_ones(client, worker):
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=2, ignore_eos=True))
    run_rounds(client, worker, 2)
    assert read_events(client, "r")[-1].finished and "r" in worker.sessions  # until its commit's reply is read
    worker.turn(0.0)  # no forward to overlap: the replies now
    assert "r" not in worker.sessions
    lose_last_events(client, 1)  # the finished event: no later commit would notice
    assert worker.commits.refill(worker.commits.committed.tracked()) == 1
    assert read_events(client, "r")[-1].finished and len(read_events(client, "r")) == 2
    assert worker.commits.refill(worker.commits.committed.tracked()) == 0  # whole: nothing appended twice


def test_a_stream_that_lost_more_than_is_kept_ends_with_an_error(client, worker, monkeypatch):
    monkeypatch.setattr("verify_worker.committed.KEEP_EVENTS", 1)
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True))
    run_rounds(client, worker, 3)
    lose_last_events(client, 2)
    worker.commits.refill(["r"])
    events = read_events(client, "r")
    assert len(events) == 2 and events[-1].finish_reason == "error" and "lost more" in events[-1].error
    assert "r" not in worker.sessions


def bridge(client, worker, rounds: int) -> None:
    """Turns without a block: each runs one bridged target-only round of the session."""
    for _ in range(rounds):
        before = len(read_events(client, "r"))
        while len(read_events(client, "r")) == before:
            worker.turn(0.05)


def test_between_a_verdict_and_the_next_block_the_worker_decodes_on_and_the_block_goes_on_from_there(client, bridging):
    worker = bridging
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True))
    out = greedy(worker, 20)
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT), out[0:2], block_id=1).encode())
    while not verdicts(client):
        worker.turn(0.1)
    bridge(client, bridging, 3)  # the next block is on its way: the target commits out[3:6] meanwhile
    assert output_tokens(client, "r") == out[:6] and len(verdicts(client)) == 1
    # drafted from the first verdict: its first 3 tokens are the bridged ones, the rest is verified from there
    worker._admit([(block(1, len(PROMPT) + 3, [*out[3:8], (out[8] + 1) % 96], block_id=2).encode(), False)])
    session = worker.sessions.get("r")
    assert session.target.draft_ids == [out[6], out[7], (out[8] + 1) % 96]
    while len(verdicts(client)) < 2:
        worker.turn(0.1)
    verdict = verdicts(client)[-1]
    assert (verdict.round, verdict.num_rounds, verdict.num_bridged) == (1, 4, 3)
    assert (verdict.num_draft_tokens, verdict.num_accepted) == (6, 5)
    assert verdict.committed_ids == out[3:9] and output_tokens(client, "r") == out[:9]
    # a block drafted from that verdict whose second token is not what the bridge committed: answered at once
    bridge(client, bridging, 3)
    worker._admit([(block(5, len(PROMPT) + 9, [out[9], 0 if out[10] else 1, out[11]], block_id=3).encode(), False)])
    verdict = verdicts(client)[-1]
    assert (verdict.block_id, verdict.num_rounds, verdict.num_accepted) == (3, 3, 1)
    assert verdict.committed_ids == out[9:12] and session.bridging  # and the bridge goes on
    while not read_events(client, "r")[-1].finished:
        worker.turn(0.05)
    assert output_tokens(client, "r") == out and read_events(client, "r")[-1].finished


def test_a_chained_block_after_a_bridged_parent_takes_the_round_after_its_verdict(client, bridging):
    worker = bridging
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True))
    out = greedy(worker, 20)
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT), [], block_id=1).encode())
    while not verdicts(client):
        worker.turn(0.1)
    bridge(client, bridging, 2)  # out[1:3]
    parent = block(1, len(PROMPT) + 1, out[1:5], block_id=2)
    child = chained(parent, 3, out[5], out[6:8])  # numbered round 2 when drafted
    worker._admit([(parent.encode(), False), (child.encode(), False)])
    while len(verdicts(client)) < 3:
        worker.turn(0.1)
    first, second = verdicts(client)[1:]
    assert (first.round, first.num_rounds, first.num_bridged, first.num_accepted) == (1, 3, 2, 4)
    assert (second.block_id, second.round, second.num_accepted) == (3, 4, 2)  # the round after the parent's
    assert output_tokens(client, "r") == out[:9]
    assert [event.seq for event in read_events(client, "r")] == list(range(5))


@pytest.mark.timeout(60)  # without a bridge, bridge() would wait for ever
def test_after_target_only_rounds_the_worker_decodes_on_until_the_next_block_and_not_after_a_drafted_one(
        client, worker):
    """scheduler.bridge off: after target-only rounds past the opening (the load's word, a fallback) the draft
    drafted nothing, and the worker decodes on while the verdict and the next block cross the link; a block
    drafted from that verdict goes on from the bridge. After a drafted block, and for seeded sampling, it waits."""
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True))
    out = greedy(worker, 20)
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT), block_id=1).encode())
    turn_until(worker, lambda: verdicts(client))
    session = worker.sessions.get("r")
    assert not session.has_work  # the opening: its draft drafts the first block meanwhile
    worker._admit([(block(1, len(PROMPT) + 1, num_rounds=3, block_id=2).encode(), False)])
    turn_until(worker, lambda: len(verdicts(client)) == 2)
    assert session.bridging
    bridge(client, worker, 2)
    assert output_tokens(client, "r") == out[:6] and len(verdicts(client)) == 2
    worker._admit([(block(4, len(PROMPT) + 4, out[4:9], block_id=3).encode(), False)])
    turn_until(worker, lambda: len(verdicts(client)) == 3)
    verdict = verdicts(client)[-1]
    assert (verdict.num_bridged, verdict.num_accepted, verdict.committed_ids) == (2, 5, out[4:10])
    assert not session.has_work  # no bridge after a drafted block
    sampling = SamplingParams(temperature=0.9, seed=3)
    submit_spec(client, SessionSpec(request_id="s", prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True,
                                    sampling=sampling))
    seeded = [DraftBlock(request_id="s", round=0, num_committed=len(PROMPT), draft_ids=[], reply_to=REPLY),
              DraftBlock(request_id="s", round=1, num_committed=len(PROMPT) + 1, draft_ids=[], reply_to=REPLY,
                         num_rounds=2)]
    for sent, block_sent in enumerate(seeded, start=1):
        client.rpush(verify_pool_queue("cpu"), block_sent.encode())
        turn_until(worker, lambda: len([v for v in verdicts(client) if v.request_id == "s"]) == sent)
    assert not worker.sessions.get("s").has_work and len(output_tokens(client, "s")) == 3


@pytest.mark.timeout(60)  # without a bridge, bridge() would wait for ever
def test_a_drafted_block_answered_at_once_behind_the_bridge_leaves_the_bridge_going(client, worker):
    """scheduler.bridge off: a drafted block that comes after the bridge went past it, or away from it, is answered
    at once (bridging.py); the worker decodes on while that verdict and the next block cross the link (measured
    behind 100 ms: it idled 320-430 ms there, the draft's first block of a request after its opening). A block that
    goes on from the bridge is verified, and after its verdict the worker waits as after any drafted block."""
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True))
    out = greedy(worker, 20)
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT), block_id=1).encode())
    turn_until(worker, lambda: verdicts(client))
    worker._admit([(block(1, len(PROMPT) + 1, num_rounds=3, block_id=2).encode(), False)])
    turn_until(worker, lambda: len(verdicts(client)) == 2)
    session = worker.sessions.get("r")
    bridge(client, worker, 3)  # out[4:7]
    # drafted from the last verdict, its second token not the target's: answered at once, and the bridge goes on
    worker._admit([(block(4, len(PROMPT) + 4, [out[4], (out[5] + 1) % 96, out[6]], block_id=3).encode(), False)])
    verdict = verdicts(client)[-1]
    assert (verdict.block_id, verdict.num_bridged, verdict.num_accepted, verdict.committed_ids) == (3, 3, 1, out[4:7])
    assert session.bridging
    bridge(client, worker, 2)  # out[7:9]
    worker._admit([(block(7, len(PROMPT) + 7, out[7:12], block_id=4).encode(), False)])  # from that verdict
    turn_until(worker, lambda: len(verdicts(client)) == 4)
    verdict = verdicts(client)[-1]
    assert (verdict.num_bridged, verdict.num_accepted, verdict.committed_ids) == (2, 5, out[7:13])
    assert output_tokens(client, "r") == out[:13] and not session.has_work  # no bridge after a verified block


@pytest.mark.timeout(60)  # without a bridge, bridge() would wait for ever
def test_a_plain_route_session_decodes_on_between_its_blocks_and_seeded_draws_stay_the_same(client, worker):
    """The plain route bridges whatever scheduler.bridge says (`worker` does not bridge the speculative route):
    its blocks are target-only rounds that a draft worker sends after each verdict, a trip over the draft link
    each. A seeded sampled request commits the tokens of one block of all its rounds."""
    def spec(request_id: str) -> SessionSpec:
        return SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=12, ignore_eos=True,
                           sampling=SamplingParams(temperature=0.9, seed=11), route="ar")

    submit_spec(client, spec("whole"))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="whole", round=0, num_committed=len(PROMPT),
                                                      draft_ids=[], reply_to=REPLY, num_rounds=12).encode())
    while not read_events(client, "whole") or not read_events(client, "whole")[-1].finished:
        worker.turn(0.05)
    submit_spec(client, spec("r"))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT)).encode())  # round 0 alone, as the gateway opens it
    while not [v for v in verdicts(client) if v.request_id == "r"]:
        worker.turn(0.1)
    bridge(client, worker, 3)  # no block on its way yet: the target decodes on
    assert len(output_tokens(client, "r")) == 4 and len([v for v in verdicts(client) if v.request_id == "r"]) == 1
    # the draft's block of the rest, sent from the first verdict: it takes over the rounds bridged meanwhile
    worker._admit([(block(1, len(PROMPT) + 1, num_rounds=11).encode(), False)])
    while not read_events(client, "r")[-1].finished:
        worker.turn(0.05)
    assert output_tokens(client, "r") == output_tokens(client, "whole") and len(output_tokens(client, "r")) == 12
    last = [v for v in verdicts(client) if v.request_id == "r"][-1]
    assert (last.round, last.num_rounds) == (1, 11)


def test_a_seeded_sampled_session_does_not_bridge(client, bridging):
    worker = bridging
    sampling = SamplingParams(temperature=0.9, seed=11)
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True,
                                    sampling=sampling))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT)).encode())
    while not verdicts(client):
        worker.turn(0.1)
    for _ in range(3):
        worker.turn(0.02)
    assert not worker.sessions.get("r").has_work and len(read_events(client, "r")) == 1


def test_a_bridged_round_does_not_start_when_the_next_block_is_due_within_a_step(client, bridging):
    worker = bridging
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT)).encode())
    while not verdicts(client):
        worker.turn(0.1)
    session = worker.sessions.get("r")
    assert session.bridge_wait(0.03) == 0.0  # no gap measured yet: bridge at once
    session.gaps[False] = 0.1  # blocks come 100 ms after such a verdict
    start = session.last_verdict_at
    assert session.bridge_wait(0.03, now=start) == 0.0  # a step ends well before
    assert session.bridge_wait(0.03, now=start + 0.08) == pytest.approx(0.12)  # it would hold the block up
    assert session.bridge_wait(0.03, now=start + 0.25) == 0.0  # late by twice its gap: not counted on
    # on the real clock, with bounds from readings taken around each call: the box may pause anywhere in between
    verdict_at = session.last_verdict_at = time.monotonic() - 0.08
    worker._step_s = 0.03
    ready, wait = worker._ready(), worker._bridge_wait()
    waited = time.monotonic() - verdict_at  # 0.08 s and what the box took since
    # held until twice the gap, unless the block is already that late here
    assert wait <= 0.12 and (ready == [] and wait > 0.0 or waited >= 0.2), (ready, wait, waited)
    worker._admit([(block(1, verdicts(client)[0].num_committed, [1, 2]).encode(), False)])
    gap = time.monotonic() - verdict_at
    # the gap measured (at least 0.08 s, at most until now), smoothed into the 0.1 s one with weight 0.3
    assert session.block is not None
    assert 0.7 * 0.1 + 0.3 * 0.08 - 1e-9 <= session.gaps[False] <= 0.7 * 0.1 + 0.3 * gap + 1e-9, (session.gaps, gap)


@pytest.fixture
def wide(client):
    """A worker on one torch thread that may borrow a second core (worker.wide_threads), with the threads each
    forward ran on."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    worker = VerifyWorker(client=client, engine=TorchEngine(build_tiny_llama(0)), worker_id="verify-w", pool="cpu",
                          wide_threads=2)
    worker.wide_min_tokens = 1  # every step is big enough to go wide: this is about whose draft is busy
    forward, worker.forward_threads = worker.engine.forward, []

    def recording(rows):
        worker.forward_threads.append(torch.get_num_threads())
        return forward(rows)

    worker.engine.forward = recording
    yield worker
    torch.set_num_threads(before)


def finished(client, request_id: str) -> bool:
    events = read_events(client, request_id)
    return bool(events) and events[-1].finished


def turn_until(worker, done) -> list[int]:
    """Turns until done(); the threads of the forwards they ran (recorded by the `wide` fixture's worker)."""
    threads = getattr(worker, "forward_threads", [])
    start = len(threads)
    deadline = time.monotonic() + 30
    while not done():
        assert time.monotonic() < deadline
        worker.turn(0.1)
    return threads[start:]


def test_a_step_borrows_the_draft_core_only_while_no_session_keeps_a_draft_busy(client, wide):
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=16, ignore_eos=True))
    # round 0 target-only (an opening): the draft speculates the next block meanwhile
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT)).encode())
    assert set(turn_until(wide, lambda: verdicts(client))) == {1}
    client.rpush(verify_pool_queue("cpu"), block(1, verdicts(client)[-1].num_committed, [3, 4]).encode())
    assert set(turn_until(wide, lambda: len(verdicts(client)) == 2)) == {1}  # drafted: its draft drafts meanwhile
    # target-only rounds after round 0: the draft waits for their verdict, its core is free
    client.rpush(verify_pool_queue("cpu"), block(2, verdicts(client)[-1].num_committed, num_rounds=4).encode())
    assert turn_until(wide, lambda: len(verdicts(client)) == 3) == [2, 2, 2, 2]
    assert wide.figures.counters.wide_steps == 4 and wide.figures.heartbeat_fields()["step_counters"]["wide_steps"] == 4
    client.rpush(verify_pool_queue("cpu"), block(6, verdicts(client)[-1].num_committed, [5]).encode())
    assert set(turn_until(wide, lambda: len(verdicts(client)) == 4)) == {1}  # drafting again
    # the plain route beside it: narrow while "r" waits for the block its draft is drafting, wide once "r" is done
    submit_spec(client, SessionSpec(request_id="p", prompt_ids=PROMPT, max_new_tokens=3, ignore_eos=True, route="ar"))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="p", round=0, num_committed=len(PROMPT),
                                                      draft_ids=[], num_rounds=3, reply_to=REPLY).encode())
    assert set(turn_until(wide, lambda: finished(client, "p"))) == {1}
    wide.sessions.pop("r")
    submit_spec(client, SessionSpec(request_id="q", prompt_ids=PROMPT[:7], max_new_tokens=3, ignore_eos=True,
                                    route="ar"))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="q", round=0, num_committed=7, draft_ids=[],
                                                      num_rounds=3, reply_to=REPLY).encode())
    assert set(turn_until(wide, lambda: finished(client, "q"))) == {2}


def test_only_a_step_big_enough_to_gain_from_a_second_core_borrows_it(client, wide):
    """A lone stream's one-token steps are bound by memory: a second thread only adds its wait. A prompt's
    prefill is bound by compute."""
    wide.wide_min_tokens = len(PROMPT)
    submit_spec(client, SessionSpec(request_id="p", prompt_ids=PROMPT, max_new_tokens=3, ignore_eos=True, route="ar"))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="p", round=0, num_committed=len(PROMPT),
                                                      draft_ids=[], num_rounds=3, reply_to=REPLY).encode())
    assert turn_until(wide, lambda: finished(client, "p")) == [2, 1, 1]  # the prompt, then one token a step


def test_a_small_step_borrows_the_draft_core_only_while_no_draft_may_be_drafting(client, wide):
    """plain_wide_min_tokens (timed at start: services/engine/wide_steps.py) holds while no session's draft may
    be drafting: the plain route, and target-only rounds after round 0 (its draft waits for their verdict).
    Beside an opening or a drafted block, steps under wide_min_tokens stay on `threads`."""
    wide.wide_min_tokens, wide.plain_wide_min_tokens = len(PROMPT), 1
    submit_spec(client, SessionSpec(request_id="p", prompt_ids=PROMPT, max_new_tokens=3, ignore_eos=True, route="ar"))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="p", round=0, num_committed=len(PROMPT),
                                                      draft_ids=[], num_rounds=3, reply_to=REPLY).encode())
    assert turn_until(wide, lambda: finished(client, "p")) == [2, 2, 2]  # one token a step, on both cores
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=16, ignore_eos=True))
    answered = len(verdicts(client))  # p's
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT)).encode())
    assert turn_until(wide, lambda: len(verdicts(client)) == answered + 1) == [1]  # the draft speculates meanwhile
    client.rpush(verify_pool_queue("cpu"), block(1, verdicts(client)[-1].num_committed, num_rounds=3).encode())
    assert turn_until(wide, lambda: len(verdicts(client)) == answered + 2) == [2, 2, 2]  # its draft waits
    client.rpush(verify_pool_queue("cpu"), block(4, verdicts(client)[-1].num_committed, [3, 4]).encode())
    assert set(turn_until(wide, lambda: len(verdicts(client)) == answered + 3)) == {1}  # drafted: it drafts on
    assert wide.figures.counters.wide_steps == 6


def test_a_draft_prefilling_after_the_opening_leaves_the_opening_every_core_and_the_worker_bridges_until_its_block(
        client, wide):
    """speculative.draft_prefill "after_opening" (one box): the opening round's prefill is wide, the worker decodes
    the session on its own while the draft prefills, and the first drafted block fast-forwards over those tokens;
    after it the session waits for its blocks as usual (scheduler.bridge is off)."""
    wide.draft_after_opening = True
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=20, ignore_eos=True))
    out = greedy(wide, 20)
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT), block_id=1).encode())
    assert set(turn_until(wide, lambda: verdicts(client))) == {2}
    session = wide.sessions.get("r")
    assert session.bridging and session.keeps_a_draft_busy  # its draft prefills now, on the other core
    start = len(wide.forward_threads)
    bridge(client, wide, 3)
    assert set(wide.forward_threads[start:]) == {1} and output_tokens(client, "r") == out[:4]
    wide._admit([(block(1, len(PROMPT) + 1, out[1:7], block_id=2).encode(), False)])
    turn_until(wide, lambda: len(verdicts(client)) == 2)
    verdict = verdicts(client)[-1]
    assert (verdict.num_bridged, verdict.num_accepted, verdict.committed_ids) == (3, 6, out[1:8])
    assert not session.bridging and not session.has_work  # no bridge after a drafted block
    # a seeded sampled session opens wide too (its draft defers alike) but never bridges
    submit_spec(client, SessionSpec(request_id="s", prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True,
                                    sampling=SamplingParams(temperature=0.9, seed=3)))
    wide.sessions.pop("r")
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="s", round=0, num_committed=len(PROMPT),
                                                      draft_ids=[], reply_to=REPLY).encode())
    assert set(turn_until(wide, lambda: len(verdicts(client)) == 3)) == {2}
    assert not wide.sessions.get("s").has_work


def test_without_the_setting_an_opening_keeps_the_draft_busy_and_no_bridge_follows(client, wide):
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT), block_id=1).encode())
    assert set(turn_until(wide, lambda: verdicts(client))) == {1}
    assert not wide.sessions.get("r").has_work


def test_a_wait_on_a_draft_whose_last_word_at_this_load_was_target_only_rounds_leaves_the_step_wide(client, wide):
    """verify_worker/draft_word.py: after an opening, whether the draft prefills (busy) or sends target-only rounds
    (idle) is its call at this load; once it said target-only rounds at this load, the next opener's wait runs
    wide, and a drafted block makes waits count as busy again."""
    wide.draft_after_opening = True
    for request_id in ("r", "s"):
        submit_spec(client, SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=24, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT), block_id=1).encode())
    turn_until(wide, lambda: verdicts(client))
    r = wide.sessions.get("r")
    assert r.awaits_draft_call and wide._draft_busy()  # nothing heard from the draft yet: it may be prefilling
    # its draft's answer: target-only rounds (the load makes drafting lose)
    wide._admit([(block(1, len(PROMPT) + 1, num_rounds=8, block_id=2).encode(), False)])
    assert wide.draft_word.plain_at == 1 and not wide._draft_busy()
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="s", round=0, num_committed=len(PROMPT), draft_ids=[],
                                                      reply_to=REPLY, block_id=1).encode())
    turn_until(wide, lambda: any(v.request_id == "s" for v in verdicts(client)))
    s = wide.sessions.get("s")
    assert s.awaits_draft_call and s.bridging and s.keeps_a_draft_busy
    # a plain-route session's target-only rounds say nothing of the draft's load
    wide.draft_word.plain_at = None
    submit_spec(client, SessionSpec(request_id="p", prompt_ids=PROMPT, max_new_tokens=24, ignore_eos=True, route="ar"))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="p", round=0, num_committed=len(PROMPT), draft_ids=[],
                                                      reply_to=REPLY, block_id=1).encode())
    turn_until(wide, lambda: any(v.request_id == "p" for v in verdicts(client)))
    wide._admit([(DraftBlock(request_id="p", round=1, num_committed=len(PROMPT) + 1, draft_ids=[], num_rounds=8,
                             reply_to=REPLY, block_id=2).encode(), False)])
    assert wide.draft_word.plain_at is None
    wide.sessions.pop("p")
    wide._admit([(block(9, len(PROMPT) + 9, num_rounds=8, block_id=3).encode(), False)])  # "r" again: heard
    assert wide.draft_word.plain_at is not None
    start = len(wide.forward_threads)
    turn_until(wide, lambda: len(read_events(client, "s")) >= 3)  # "s" bridges beside "r"'s target-only rounds
    assert set(wide.forward_threads[start:]) == {2}
    # the draft drafts after all: its block says so, and waits keep the draft busy again
    wide._admit([(DraftBlock(request_id="s", round=1, num_committed=len(PROMPT) + 1, draft_ids=[1, 2],
                             reply_to=REPLY, block_id=2).encode(), False)])
    assert wide.draft_word.plain_at is None and wide._draft_busy()
    # fewer sessions than when the draft last said target-only rounds: a wait keeps the draft busy
    wide.draft_word.plain_at = 3
    assert not wide.draft_word.goes_plain(wide._speculative_sessions())


def test_a_worker_whose_target_only_rounds_commit_faster_tells_its_draft_so_and_the_output_stays_the_targets(
        client, worker):
    """verify_worker/load_word.py: drafted blocks that come 50 ms after their verdict (a slow draft) against
    target-only rounds the worker runs one a step: drafting is tried first, then a hold of plain rounds, and from
    then on the verdicts say plain. The tokens are the target's alone throughout."""
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=200, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT)).encode())
    words, committed = [], []
    while words[-3:] != ["plain"] * 3:
        turn_until_verdicts(worker, client, len(words) + 1)
        last = verdicts(client)[-1]
        words.append(last.load_arm)
        committed += last.committed_ids
        assert len(words) < 60, words
        following = last.round + last.num_rounds
        if last.load_arm == "plain":
            client.rpush(verify_pool_queue("cpu"), block(following, last.num_committed,
                                                         num_rounds=WORD_PLAIN_ROUNDS).encode())
        else:
            time.sleep(0.05)
            client.rpush(verify_pool_queue("cpu"), block(following, last.num_committed, [3, 4]).encode())
    assert words.index("plain") >= 8  # drafting is measured first, for a hold
    rates = worker.load_word.to_dict()["1"]
    assert rates["plain"] > rates["draft"] > 0
    assert committed == greedy(worker, len(committed))


def test_the_word_measures_no_step_of_a_sessions_start(client, bridging):
    """verify_worker/load_word.py: the bridge after an opening runs while the draft prefills and catches up, and
    its steps count in neither arm; the steps after the first block past the opening do."""
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=40, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT)).encode())
    turn_until(bridging, lambda: len(read_events(client, "r")) >= 8)  # the opening, then its bridge
    session, hold = bridging.sessions.get("r"), bridging.load_word.held[1]
    assert session.bridging and not session.opened
    assert hold.started and (hold.steps, hold.tokens) == (0, 0)
    events = read_events(client, "r")
    committed = len(PROMPT) + events[-1].num_output_tokens
    client.rpush(verify_pool_queue("cpu"), block(len(events), committed, [3, 4]).encode())
    turn_until(bridging, lambda: len(read_events(client, "r")) >= len(events) + 6)
    assert session.opened and hold.steps >= 5
    # a second request starts beside it: steps where one session starts and another is past its start are how
    # the arm runs under churn, and count
    submit_spec(client, SessionSpec(request_id="s", prompt_ids=PROMPT, max_new_tokens=40, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="s", round=0, num_committed=len(PROMPT),
                                                      draft_ids=[], reply_to=REPLY).encode())
    turn_until(bridging, lambda: len(read_events(client, "s")) >= 6)
    beside = bridging.load_word.held[load_bucket(2)]
    assert not bridging.sessions.get("s").opened and beside.started and beside.steps >= 3


def test_a_session_told_plain_and_an_opening_under_the_word_plain_leave_small_steps_every_core(client, wide):
    """A draft that heard "plain" in its verdict sends target-only rounds next and drafts nothing meanwhile, and a
    new session's draft heard the word too (its draft worker's last verdict): under that word neither keeps the
    draft busy, and a small step beside them runs wide. Without the word both count as drafting."""
    from services.speculative.measured_turns import PLAIN
    from verify_worker.load_word import Hold

    wide.wide_min_tokens, wide.plain_wide_min_tokens = len(PROMPT) + 1, 1
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=40, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT)).encode())
    turn_until(wide, lambda: verdicts(client))
    assert verdicts(client)[-1].load_arm == "" and wide.sessions.get("r").drafts_now  # waits for a drafted block
    for load in (1, 2):
        wide.load_word.held[load] = Hold(PLAIN)  # as if it measured target-only rounds faster at 1 and 2
    client.rpush(verify_pool_queue("cpu"), block(1, verdicts(client)[-1].num_committed, [3, 4]).encode())
    turn_until(wide, lambda: len(verdicts(client)) == 2)
    told = wide.sessions.get("r")
    assert verdicts(client)[-1].load_arm == "plain" and told.told_plain and not told.drafts_now
    assert not wide._draft_busy()
    # the target-only rounds the word asked for are not the draft's own word on the load (verify_worker/draft_word.py)
    client.rpush(verify_pool_queue("cpu"), block(2, verdicts(client)[-1].num_committed, num_rounds=2).encode())
    turn_until(wide, lambda: len(verdicts(client)) == 3)
    assert wide.draft_word.plain_at is None
    # the plain route beside it, then an opening: one-token steps on both cores
    submit_spec(client, SessionSpec(request_id="p", prompt_ids=PROMPT, max_new_tokens=3, ignore_eos=True, route="ar"))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="p", round=0, num_committed=len(PROMPT),
                                                      draft_ids=[], num_rounds=3, reply_to=REPLY).encode())
    assert turn_until(wide, lambda: finished(client, "p"))[1:] == [2, 2]
    submit_spec(client, SessionSpec(request_id="q", prompt_ids=PROMPT, max_new_tokens=3, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="q", round=0, num_committed=len(PROMPT),
                                                      draft_ids=[], reply_to=REPLY).encode())
    wide._admit(wide._pop(0.1))  # taken, not stepped yet
    assert wide.last_word == "plain" and wide.sessions.get("q").opens_told_plain("plain") and wide._set_threads(1)
    wide.last_word = ""  # as after a verdict without the word: the opening's draft may prefill
    assert not wide._set_threads(1)
    # a seeded sampled session's draft does not take the word (where its rounds fall decides its tokens)
    for load in (2, 3):
        wide.load_word.held[load] = Hold(PLAIN)
    seeded = SamplingParams(temperature=0.8, seed=3)
    submit_spec(client, SessionSpec(request_id="s", prompt_ids=PROMPT, max_new_tokens=8, sampling=seeded))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="s", round=0, num_committed=len(PROMPT),
                                                      draft_ids=[], reply_to=REPLY).encode())
    wide._admit(wide._pop(0.1))
    assert not wide.sessions.get("s").opens_told_plain("plain")
    turn_until(wide, lambda: any(v.request_id == "s" for v in verdicts(client)))
    answered = wide.sessions.get("s")
    assert answered.last_verdict.load_arm == "plain" and not answered.told_plain and answered.drafts_now


def turn_until_verdicts(worker, client, count: int) -> None:
    deadline = time.monotonic() + 30
    while len(verdicts(client)) < count:
        assert time.monotonic() < deadline
        worker.turn(0.1)


def test_a_prompt_is_prefilled_in_one_step_while_no_stream_runs_and_in_budgeted_chunks_beside_one(client):
    """scheduler.prefill_only_batch_tokens: chunking a prompt protects running streams' next tokens; with none
    running here it only adds steps before the first token."""
    worker = VerifyWorker(client=client, engine=TorchEngine(build_tiny_llama(0)), worker_id="verify-w", pool="cpu",
                          scheduler=SchedulerSettings(max_batch_tokens=8, prefill_only_batch_tokens=64))
    forward, fed = worker.engine.forward, []
    worker.engine.forward = lambda rows: fed.append([len(row.token_ids) for row in rows]) or forward(rows)
    long_prompt, other = PROMPT * 4, PROMPT[::-1] * 4  # no common prefix to reuse
    for request_id, prompt_ids in (("a", long_prompt), ("b", other)):
        submit_spec(client, SessionSpec(request_id=request_id, prompt_ids=prompt_ids, max_new_tokens=12,
                                        ignore_eos=True, route="ar"))
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="a", round=0, num_committed=len(long_prompt),
                                                      draft_ids=[], num_rounds=12, reply_to=REPLY).encode())
    while not read_events(client, "a"):
        worker.turn(0.1)
    assert fed == [[len(long_prompt)]]  # alone: the whole prompt in one step
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="b", round=0, num_committed=len(other),
                                                      draft_ids=[], num_rounds=12, reply_to=REPLY).encode())
    deadline = time.monotonic() + 30
    while not (finished(client, "a") and finished(client, "b")):
        assert time.monotonic() < deadline
        worker.turn(0.1)
    beside = [rows for rows in fed[1:] if len(rows) == 2]  # "a" streams one token a step, "b" prefills beside it
    assert beside and all(sum(rows) <= 8 for rows in beside)
    assert sum(rows[1] for rows in beside) >= len(other) - 8, fed  # b's prompt went in chunks
    for request_id, prompt_ids in (("a", long_prompt), ("b", other)):
        assert output_tokens(client, request_id) == greedy(worker, 12, prompt_ids)



def opening(request_id: str) -> DraftBlock:
    return DraftBlock(request_id=request_id, round=0, num_committed=len(PROMPT), draft_ids=[], reply_to=REPLY)


def verdict_of(client, request_id: str) -> Verdict | None:
    return next((v for v in reversed(verdicts(client)) if v.request_id == request_id), None)


def test_a_verdict_tells_the_rows_of_the_openings_on_their_way_and_between_bursts_the_steps_own(client, worker):
    for request_id in "abc":
        submit_spec(client, SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), opening("a").encode())
    forward = worker.engine.forward

    def burst_arrives(rows):  # the rest of the burst comes in while "a" is prefilled alone
        if worker.sessions.get("b") is None and not client.llen(verify_pool_queue("cpu")):
            client.rpush(verify_pool_queue("cpu"), opening("b").encode(), opening("c").encode())
        return forward(rows)

    worker.engine.forward = burst_arrives
    turn_until(worker, lambda: verdict_of(client, "a"))
    assert verdict_of(client, "a").batch_rows == 3  # one row stepped, two openings queued meanwhile
    assert worker.sessions.get("b") is not None and worker.sessions.get("c") is not None  # taken after the verdicts
    turn_until(worker, lambda: verdict_of(client, "b") and verdict_of(client, "c"))
    assert verdict_of(client, "b").batch_rows == verdict_of(client, "c").batch_rows == 2  # "a" waits for its block
    client.rpush(verify_pool_queue("cpu"), DraftBlock(request_id="a", round=1, num_committed=verdict_of(
        client, "a").num_committed, draft_ids=[3, 4], reply_to=REPLY).encode())
    turn_until(worker, lambda: verdict_of(client, "a").round == 1)
    assert verdict_of(client, "a").batch_rows == 1  # no opening on its way: the step's own rows


def test_a_step_whose_openings_wait_for_a_later_step_tells_them_too(client):
    worker = VerifyWorker(client=client, engine=TorchEngine(build_tiny_llama(0)), worker_id="verify-w", pool="cpu",
                          scheduler=SchedulerSettings(max_batch_tokens=len(PROMPT),
                                                      prefill_only_batch_tokens=len(PROMPT)))  # one prompt a step
    for request_id in "ab":
        submit_spec(client, SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True))
    worker._admit([(opening(request_id).encode(), True) for request_id in "ab"])
    assert worker.step() == 1 and not client.llen(verify_pool_queue("cpu"))
    stepped = [request_id for request_id in "ab" if verdict_of(client, request_id)]
    assert len(stepped) == 1 and verdict_of(client, stepped[0]).batch_rows == 2  # the other opening's step is next


def test_a_step_whose_look_at_the_queues_fails_still_commits_its_rounds(client, worker):
    submit_spec(client, SessionSpec(request_id="a", prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True))
    worker._admit([(opening("a").encode(), True)])

    def away(timeout_s, min_room=1):
        raise redis.ConnectionError("Redis away for a moment")

    worker._pop = away
    assert worker.step() == 1
    assert verdict_of(client, "a").batch_rows == 1 and len(read_events(client, "a")) == 1


def test_blocks_taken_from_the_queues_by_a_step_whose_commits_fail_are_admitted_at_the_next_turn(client, worker):
    for request_id in "ab":
        submit_spec(client, SessionSpec(request_id=request_id, prompt_ids=PROMPT, max_new_tokens=8, ignore_eos=True))
    worker._admit([(opening("a").encode(), True)])
    forward, publish = worker.engine.forward, worker.commits.publish

    def arrives(rows):  # "b" comes in during the step
        client.rpush(verify_pool_queue("cpu"), opening("b").encode())
        worker.engine.forward = forward
        return forward(rows)

    def away(items, **_):
        worker.commits.publish = publish
        raise redis.ConnectionError("Redis away for a moment")

    worker.engine.forward, worker.commits.publish = arrives, away
    with pytest.raises(redis.ConnectionError):
        worker.step()
    assert worker.sessions.get("b") is None and not client.llen(verify_pool_queue("cpu"))  # popped, held back
    turn_until(worker, lambda: verdict_of(client, "b"))
    assert worker.sessions.get("b") is not None


def test_a_steps_commits_are_in_redis_before_their_replies_are_read_and_settled_after_the_next_forward(client, worker):
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=6, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT), num_rounds=6).encode())
    worker.turn(0.1)
    assert worker.commits._pending is not None  # written, replies unread
    assert [event.seq for event in read_events(client, "r")] == [0]  # yet the gateway can read the round
    seen = []
    forward = worker.engine.forward

    def forward_seeing(rows):  # the next forward runs while the last step's replies wait
        seen.append(worker.commits._pending is not None)
        return forward(rows)

    worker.engine.forward = forward_seeing
    while "r" in worker.sessions:
        worker.turn(0.1)
    assert seen and all(seen)
    events = read_events(client, "r")
    assert [event.seq for event in events] == list(range(6)) and events[-1].finished  # each round once
    assert worker.commits._pending is None


def test_commits_written_to_a_redis_that_lost_its_scripts_are_committed_once_after_loading_them(client, worker):
    submit_spec(client, SessionSpec(request_id="r", prompt_ids=PROMPT, max_new_tokens=4, ignore_eos=True))
    client.rpush(verify_pool_queue("cpu"), block(0, len(PROMPT), num_rounds=4).encode())
    worker.turn(0.1)
    worker.commits.settle()
    client.script_flush()  # a Redis restarted empty of scripts: the next batch answers NOSCRIPT
    loads = []
    load = worker.commits.committer.load
    worker.commits.committer.load = lambda: (loads.append(1), load())
    while "r" in worker.sessions:
        worker.turn(0.1)
    assert loads == [1]  # loaded once, on the first NOSCRIPT
    events = read_events(client, "r")
    assert [event.seq for event in events] == [0, 1, 2, 3] and events[-1].finished
    assert sum(len(event.token_ids) for event in events) == 4
