"""Single-flight: the join and leave scripts against the real Redis, then identical requests through a real
stack (tiny target, real worker processes, real HTTP): one generation, every client its whole answer."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis.asyncio as aioredis

from gateway.sessions.single_flight import SingleFlight
from services import protocol
from services.gateway_client import DONE
from services.protocol import SessionSpec
from services.redis_client import REQUEST_TTL_S
from tests.conftest import WORDS, save_tiny_model
from tests.integration.stack import Stack, sse_events
from tests.redis_dbs import DATABASES


def flights_run(scenario) -> object:
    """Run `scenario(flights, client)` on an emptied database."""
    async def run(url: str):
        client = aioredis.Redis.from_url(url)
        try:
            return await scenario(SingleFlight(client), client)
        finally:
            await client.aclose()

    with DATABASES.lease() as url:
        return asyncio.run(run(url))


def test_the_first_to_join_leads_and_the_last_to_leave_early_cancels():
    async def scenario(flights, client):
        leader = await flights.join("k", "cmpl-a")
        followers = [await flights.join("k", f"cmpl-{name}") for name in "bc"]
        assert leader.leading and [f.leader_id for f in followers] == ["cmpl-a", "cmpl-a"]
        assert 0 < await client.ttl(protocol.flight_key("k")) <= REQUEST_TTL_S
        assert await flights.leave(leader, ended=False) == 2  # the leader's client gone: the others read on
        assert await flights.leave(leader, ended=False) == -1  # leaving twice (a DELETE, then its reader)
        assert await flights.leave(followers[0], ended=False) == 1
        assert await flights.leave(followers[1], ended=False) == 0  # the last: it cancels the generation
        assert not await client.exists(protocol.flight_key("k"))

    flights_run(scenario)


def test_a_generation_that_ended_frees_the_key_for_a_fresh_one_and_old_readers_cannot_touch_it():
    async def scenario(flights, client):
        old_leader = await flights.join("k", "cmpl-a")
        old_follower = await flights.join("k", "cmpl-b")
        assert await flights.leave(old_follower, ended=True) == -1  # the first reader to see the end
        assert not await client.exists(protocol.flight_key("k"))
        fresh = await flights.join("k", "cmpl-c")
        assert fresh.leading  # not a result cache: a later identical request generates anew
        assert await flights.leave(old_leader, ended=False) == -1  # another flight's hash: not counted
        assert await flights.leave(old_leader, ended=True) == -1  # nor deleted
        assert (await client.hget(protocol.flight_key("k"), "leader")) == b"cmpl-c"
        assert await flights.leave(fresh, ended=False) == 0

    flights_run(scenario)


def test_joins_and_leaves_at_once_elect_one_leader_and_one_last():
    async def scenario(flights, client):
        joined = await asyncio.gather(*(flights.join("k", f"cmpl-{n}") for n in range(40)))
        assert sum(f.leading for f in joined) == 1 and len({f.leader_id for f in joined}) == 1
        left = await asyncio.gather(*(flights.leave(f, ended=False) for f in joined))
        assert sorted(left) == list(range(40))  # every count from 39 down to 0, each once

    flights_run(scenario)


def test_a_follower_waits_for_the_leaders_spec_or_for_its_giving_up():
    spec = SessionSpec(request_id="cmpl-a", prompt_ids=[1, 2], max_new_tokens=4)

    async def scenario(flights, client):
        leader = await flights.join("k", "cmpl-a")
        follower = await flights.join("k", "cmpl-b")

        async def write_spec_later():
            await asyncio.sleep(0.1)
            await client.set(protocol.request_key("cmpl-a"), spec.encode())

        found, _ = await asyncio.gather(flights.leader_spec(follower), write_spec_later())
        assert found == spec
        await client.delete(protocol.request_key("cmpl-a"))

        async def give_up_later():
            await asyncio.sleep(0.1)
            await flights.leave(leader, ended=True)  # e.g. no verify worker serving: the leader got a 503

        gave_up, _ = await asyncio.gather(flights.leader_spec(follower), give_up_later())
        assert gave_up is None  # the caller joins again, and leads
        assert (await flights.join("k", "cmpl-b")).leading
        # a leader that died between its join and its spec: the waiter ends the flight after wait_s
        stuck = await flights.join("k", "cmpl-c")
        started = time.monotonic()
        assert await flights.leader_spec(stuck, wait_s=0.2) is None and time.monotonic() - started >= 0.2
        assert not await client.exists(protocol.flight_key("k"))

    flights_run(scenario)


# --- a real stack ------------------------------------------------------------------------------------------

NUM_CLIENTS = 6
MAX_TOKENS = 200  # with ignore_eos: long enough for every client to join while it runs
PROMPT = " ".join(WORDS[2:12])
PROMPT_IDS = list(range(2, 12))  # the same prompt, tokenized by the client (the tiny tokenizer is one id a word)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    root = tmp_path_factory.mktemp("single-flight")
    target = save_tiny_model(root / "target", seed=0, words=WORDS)
    running = Stack(root, verify_workers=1, auth=False,
                    env={"MIRROR_SD_TARGET": str(target), "MIRROR_SD_DRAFT": "ngram"})
    try:
        yield running.start()
    finally:
        running.stop()


@pytest.fixture(scope="module")
def model(stack) -> str:
    return httpx.get(f"{stack.base_url}/v1/models").json()["data"][0]["id"]


def body(model: str, **extra) -> dict:
    return {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **extra}


def generations(stack) -> set[str]:
    """Sessions that generated: each has its own output stream."""
    return {key.decode() for key in stack.redis.scan_iter(match=protocol.output_stream("*"))}


def stream_answer(base_url: str, payload: dict, *, stop_when=None, on_first=None) -> dict:
    """One SSE completion; its id, token ids, finish reason and usage chunk (include_usage)."""
    answer = {"id": None, "token_ids": None, "finish_reason": None, "usage": None, "chunks": 0}
    with httpx.stream("POST", f"{base_url}/v1/completions", timeout=120,
                      json={**payload, "stream": True, "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200, response.read()
        for chunk in sse_events(response):
            if chunk == DONE:
                continue
            answer["id"] = chunk["id"]
            if not chunk["choices"]:
                answer["usage"] = chunk
                continue
            answer["chunks"] += 1
            if answer["chunks"] == 1 and on_first is not None:
                on_first(chunk["id"])
            choice = chunk["choices"][0]
            if choice["finish_reason"] is not None:
                answer["token_ids"], answer["finish_reason"] = choice.get("token_ids"), choice["finish_reason"]
            if stop_when is not None and stop_when(answer["chunks"]):
                break  # the client goes away mid-answer
    return answer


def post_answer(base_url: str, payload: dict) -> dict:
    response = httpx.post(f"{base_url}/v1/completions", json=payload, timeout=120)
    assert response.status_code == 200, response.text
    data = response.json()
    return {"id": data["id"], "token_ids": data["choices"][0]["token_ids"],
            "finish_reason": data["choices"][0]["finish_reason"], "usage": data, "text": data["choices"][0]["text"]}


def scrape(stack) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{stack.base_url}/metrics").text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def rows(stack, ids) -> dict[str, dict]:
    return {request_id: httpx.get(f"{stack.base_url}/v1/requests/{request_id}").json() for request_id in ids}


def live_tokens(stack) -> int:
    """Tokens the gateway counted for its tokens/s over the last minute (whole seconds only)."""
    return sum(row["tokens_per_s"] for row in httpx.get(f"{stack.base_url}/v1/dashboard").json()["throughput"])


class Hold:
    """SIGSTOP the only verify worker on a leader's first chunk, so its generation holds still, mid-answer,
    while other clients join and leave; SIGCONT on the way out. (Holds stay well under the 3 s its
    heartbeat lives; a follower's join does not look at heartbeats.)"""

    def __init__(self, stack) -> None:
        self.process = stack.processes[stack.verify_ids[0]]
        self.held = threading.Event()

    def __call__(self, _request_id: str) -> None:
        if not self.held.is_set():
            self.process.send_signal(signal.SIGSTOP)
            self.held.set()

    def __enter__(self) -> "Hold":
        return self

    def __exit__(self, *_) -> None:
        self.process.send_signal(signal.SIGCONT)

    def wait(self) -> None:
        assert self.held.wait(60), "the leader never got a first chunk"


def flight_size(stack) -> int:
    """Fields of the one flight hash there is: its leader plus one per subscriber (0: no flight)."""
    keys = list(stack.redis.scan_iter(match=protocol.flight_key("*")))
    assert len(keys) <= 1, keys
    return stack.redis.hlen(keys[0]) if keys else 0


def last_event(stack, request_id: str) -> protocol.OutputEvent:
    (_, fields), = stack.redis.xrevrange(protocol.output_stream(request_id), count=1)
    return protocol.OutputEvent.decode(fields[b"m"])


def test_identical_greedy_requests_at_once_cost_one_generation(stack, model):
    # a different request (fewer tokens): its own session
    token_prompt = post_answer(stack.base_url, body(model, max_tokens=1))["usage"]
    time.sleep(1.1)  # its tokens are in a whole second of tokens/s, before the count below starts
    before_streams, before, before_tokens = generations(stack), scrape(stack), live_tokens(stack)
    with ThreadPoolExecutor(max_workers=NUM_CLIENTS) as pool, Hold(stack) as hold:
        leader = pool.submit(stream_answer, stack.base_url, body(model), on_first=hold)
        hold.wait()
        # the rest join mid-answer: streamed and not, the prompt as text and as the same token ids
        followers = [pool.submit(stream_answer, stack.base_url, body(model)),
                     pool.submit(post_answer, stack.base_url, body(model)),
                     pool.submit(post_answer, stack.base_url, body(model, return_token_ids=True, user="other")),
                     pool.submit(stream_answer, stack.base_url, body(model, prompt=PROMPT_IDS)),
                     pool.submit(post_answer, stack.base_url, body(model))]
        wait_until(lambda: flight_size(stack) == 1 + NUM_CLIENTS)
    answers = [leader.result(timeout=120)] + [f.result(timeout=120) for f in followers]

    assert all(a["finish_reason"] == "length" and len(a["token_ids"]) == MAX_TOKENS for a in answers), answers
    assert all(a["token_ids"] == answers[0]["token_ids"] for a in answers)
    texts = {a["text"] for a in answers if "text" in a}
    assert len(texts) == 1 and texts != {""}
    leader_id = answers[0]["id"]
    assert generations(stack) - before_streams == {protocol.output_stream(leader_id)}  # one for all six
    stats = [a["usage"]["mirror_sd"] for a in answers]
    assert [s["merged_into"] for s in stats] == [None] + [leader_id] * (NUM_CLIENTS - 1)
    assert [s["request_id"] for s in stats] == [a["id"] for a in answers]  # each client its own id
    assert token_prompt["mirror_sd"]["merged_into"] is None
    after = scrape(stack)
    assert after["mirror_sd:single_flight_merged_total"] - before.get("mirror_sd:single_flight_merged_total", 0) \
        == NUM_CLIENTS - 1
    assert after["mirror_sd:requests_total"] - before["mirror_sd:requests_total"] == NUM_CLIENTS
    # drafting counted once: the leader's generation, not once per reader
    assert stats[0]["num_draft_tokens"] > 0 and all(s["num_draft_tokens"] == stats[0]["num_draft_tokens"]
                                                     for s in stats)
    assert after["mirror_sd:spec_decode_num_draft_tokens_total"] \
        - before["mirror_sd:spec_decode_num_draft_tokens_total"] == stats[0]["num_draft_tokens"]
    recorded = rows(stack, [a["id"] for a in answers])
    assert all(recorded[a["id"]]["params"]["merged_into"] == leader_id for a in answers[1:])
    assert all(r["status"] == "finished" and r["completion_tokens"] == MAX_TOKENS for r in recorded.values())
    # the followers' rows are their gateway's record, with no driver's to follow (the work is on the leader's)
    assert all(recorded[a["id"]]["mirror_sd"]["recorded_by"] == "client" for a in answers[1:])
    events = httpx.get(f"{stack.base_url}/v1/telemetry").json()["events"]
    assert {e["request_id"] for e in events if e["kind"] == "merged"} == {a["id"] for a in answers[1:]}
    time.sleep(1.6)  # the last token's second is over, and the dashboard's 0.5 s cache
    assert live_tokens(stack) - before_tokens == MAX_TOKENS  # tokens/s: generated once, read six times
    assert flight_size(stack) == 0  # ended: the next one starts afresh
    again = post_answer(stack.base_url, body(model))
    assert again["usage"]["mirror_sd"]["merged_into"] is None and again["token_ids"] == answers[0]["token_ids"]


def test_a_client_leaving_early_does_not_cut_the_others(stack, model):
    """The leader's client goes away mid-answer while two followers read: the generation runs on."""
    joined = threading.Event()
    with ThreadPoolExecutor(max_workers=3) as pool, Hold(stack) as hold:
        leader = pool.submit(stream_answer, stack.base_url, body(model), on_first=hold,
                             stop_when=lambda _: joined.wait(60))
        hold.wait()
        followers = [pool.submit(stream_answer, stack.base_url, body(model)),
                     pool.submit(post_answer, stack.base_url, body(model))]
        wait_until(lambda: flight_size(stack) == 4)
        joined.set()
        left = leader.result(timeout=120)
        wait_until(lambda: flight_size(stack) == 3)  # its gateway has seen it go, mid-generation
        assert not last_event(stack, left["id"]).finished
    answers = [f.result(timeout=120) for f in followers]
    assert left["finish_reason"] is None and left["chunks"] == 1
    for answer in answers:
        assert answer["finish_reason"] == "length" and len(answer["token_ids"]) == MAX_TOKENS
        assert answer["usage"]["mirror_sd"]["merged_into"] == left["id"]
    assert last_event(stack, left["id"]).finish_reason == "length"


def test_when_every_client_has_gone_the_generation_stops(stack, model):
    joined = threading.Event()
    with ThreadPoolExecutor(max_workers=2) as pool, Hold(stack) as hold:
        leader = pool.submit(stream_answer, stack.base_url, body(model), on_first=hold,
                             stop_when=lambda _: joined.wait(60))
        hold.wait()
        follower = pool.submit(stream_answer, stack.base_url, body(model), stop_when=lambda _: joined.wait(60))
        wait_until(lambda: flight_size(stack) == 3)
        joined.set()
        answers = [leader.result(timeout=120), follower.result(timeout=120)]
        wait_until(lambda: flight_size(stack) == 0)  # the last one out deleted the flight and cancelled
        leader_id, follower_id = answers[0]["id"], answers[1]["id"]
        # the draft side ends the stream while the verify worker still holds still: once it runs again, the
        # tiny model would otherwise finish the answer before it looks for the cancellation
        final = wait_until(lambda: (lambda e: e if e.finished else None)(last_event(stack, leader_id)))
    assert all(a["finish_reason"] is None for a in answers)
    assert follower_id != leader_id
    assert final.finish_reason == "cancelled" and final.num_output_tokens < MAX_TOKENS
    assert wait_until(lambda: rows(stack, [follower_id])[follower_id]["status"] == "cancelled")


def test_deleting_one_subscriber_ends_its_answer_alone(stack, model):
    with ThreadPoolExecutor(max_workers=2) as pool, Hold(stack) as hold:
        leader = pool.submit(stream_answer, stack.base_url, body(model), on_first=hold)
        hold.wait()
        follower_ids = []
        follower = pool.submit(stream_answer, stack.base_url, body(model), on_first=follower_ids.append)
        wait_until(lambda: follower_ids)
        deleted = httpx.delete(f"{stack.base_url}/v1/requests/{follower_ids[0]}").json()
        assert deleted["cancelled"] is True
        cut = follower.result(timeout=20)  # while the generation holds still
    whole = leader.result(timeout=120)
    assert cut["finish_reason"] == "cancelled" and len(cut["token_ids"]) < MAX_TOKENS
    assert whole["finish_reason"] == "length" and len(whole["token_ids"]) == MAX_TOKENS
    assert cut["token_ids"] == whole["token_ids"][:len(cut["token_ids"])]
    assert wait_until(lambda: rows(stack, [cut["id"]])[cut["id"]]["status"] == "cancelled")
    assert httpx.delete(f"{stack.base_url}/v1/requests/{cut['id']}").json()["cancelled"] is False


def test_sampled_requests_merge_only_with_the_same_seed(stack, model):
    sampled = {"temperature": 0.8}
    before_streams = generations(stack)
    with ThreadPoolExecutor(max_workers=4) as pool:
        other_seed = pool.submit(post_answer, stack.base_url, body(model, **sampled, seed=8))
        no_seed = pool.submit(post_answer, stack.base_url, body(model, **sampled))
        with Hold(stack) as hold:
            first = pool.submit(stream_answer, stack.base_url, body(model, **sampled, seed=7), on_first=hold)
            hold.wait()
            same = pool.submit(post_answer, stack.base_url, body(model, **sampled, seed=7))
            wait_until(lambda: any(stack.redis.hlen(key) == 3
                                   for key in stack.redis.scan_iter(match=protocol.flight_key("*"))))
        answers = [first.result(timeout=120), same.result(timeout=120), other_seed.result(timeout=120),
                   no_seed.result(timeout=120)]
    merged = [a["usage"]["mirror_sd"]["merged_into"] for a in answers]
    assert merged == [None, answers[0]["id"], None, None]
    assert answers[1]["token_ids"] == answers[0]["token_ids"]
    assert len(generations(stack) - before_streams) == 3


def wait_until(condition, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError("condition not met in time")
